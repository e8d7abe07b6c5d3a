"""Serving: ``api`` (request schema, errors, response pieces), ``serving`` (the FIFO worker queue, metrics),
``server`` (routes), ``tokenizer``, ``reference`` (the transformers backend, on the contract alone) and
``launch`` (the one command line of both backends).
"""
