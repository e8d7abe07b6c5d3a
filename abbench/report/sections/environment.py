"""The environment: the fingerprint's key fields (:func:`key_environment`), the full fingerprint, the prompts
and the service commands.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from abbench.report.format import Col, bullets, code, env_value, fmt_int, table
from abbench.report.sections.base import ReportInput


def _dig(d: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def key_environment(env: dict[str, Any]) -> list[tuple[str, Any]]:
    """The fingerprint's key fields (the ones :mod:`abbench.fingerprint` compares runs on, and what a reader
    looks for first), as (label, value) pairs; absent fields are left out."""
    gpus = env.get("gpus")
    names = [g.get("name") for g in gpus if isinstance(g, dict) and g.get("name")] if isinstance(gpus, list) else []
    pcie = _dig(gpus[0], "pcie") if isinstance(gpus, list) and gpus and isinstance(gpus[0], dict) else None
    link = (f"Gen{pcie.get('gen_current')} x{pcie.get('width_current')}"
            if isinstance(pcie, dict) and pcie.get("gen_current") else None)
    fields: list[tuple[str, Any]] = [
        ("GPU", ", ".join(names) if names else env.get("gpu")),
        ("PCIe link (GPU 0)", link),
        ("Driver", env.get("driver_version") or env.get("driver")),
        ("CUDA driver", env.get("cuda_driver_version") or env.get("cuda")),
        ("torch", _dig(env, "packages.torch") or env.get("torch")),
        ("transformers", _dig(env, "packages.transformers") or env.get("transformers")),
        ("Engine commit", env.get("engine_commit")),
        ("Host", env.get("hostname")),
        ("CPU", _dig(env, "cpu.model")),
        ("Python", _dig(env, "python.version") or (env.get("python") if isinstance(env.get("python"), str) else None)),
        ("Platform", _dig(env, "platform.platform") or (env.get("platform") if isinstance(env.get("platform"), str) else None)),
        ("Tokenizer", env.get("tokenizer")),
    ]
    return [(k, v) for k, v in fields if v not in (None, "", [], {})]


def _flatten_all(v: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(v, dict) and v:
        for k, x in v.items():
            _flatten_all(x, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(v, list) and v and any(isinstance(x, (dict, list)) for x in v):
        for i, x in enumerate(v):
            _flatten_all(x, f"{prefix}[{i}]", out)
    else:
        out[prefix] = v


def environment_section(ri: ReportInput) -> list[str]:
    record = ri.record
    lines = ["## Environment", ""]
    env = record.environment
    if not env:
        lines.append("No environment fingerprint was recorded.")
    else:
        key = key_environment(env)
        if key:
            lines.append(bullets([f"**{k}:** {env_value(v)}" for k, v in key], limit=len(key)))
        else:
            lines.append("None of the key fields (GPU, driver, CUDA, torch, transformers, engine commit) "
                         "was recorded.")
        flat: dict[str, Any] = {}
        _flatten_all(env, "", flat)
        lines += ["", "<details><summary>Full fingerprint</summary>", "",
                  bullets([f"{k}: {env_value(v)}" for k, v in flat.items()], limit=len(flat)), "", "</details>"]
    if record.prompts:
        pf = pd.DataFrame([{"id": p.id, "kind": p.kind, "tokens": p.target_tokens, "count": p.token_count,
                            "sha": p.sha256[:12], "corpus": p.corpus} for p in record.prompts])
        lines += ["", "<details><summary>Prompts</summary>", "",
                  table(pf, [Col("id", "Prompt", right=False), Col("kind", "Kind", right=False),
                             Col("tokens", "Target tokens", fmt_int), Col("count", "Re-encoded", fmt_int),
                             Col("sha", "sha256", code, right=False),
                             Col("corpus", "Corpus", descriptive=True, right=False)]), "", "</details>"]
    services = [s for s in record.services if s.command]
    if services:
        lines += ["", "<details><summary>Service commands</summary>", "",
                  bullets([f"{s.key}: {env_value(s.command, 400)}" for s in services], limit=len(services)),
                  "", "</details>"]
    return lines
