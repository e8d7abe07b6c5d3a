"""The layer probe (``abbench probe RUN --prompt P --arm A --layers``): it launches services as the runner
would.

:func:`probe_layers` sends one token history (the prompt, plus the reference's first ``position`` output ids
when ``position`` > 0) to the reference arm's service and to the probed arm's, each with its arm's request
fields and ``trace_layers: true``, ``max_tokens`` 1, after a cache reset (so the whole history is prefilled
the way the arm prefills), and compares the two ``abbench.layer_trace`` objects
(:func:`abbench.diagnostics.layertrace.compare_traces`). Both arms must speak the vendored engine's API (adapter
``openai``: the vendored engine or ``abbench serve --backend transformers``); a launched service gets
``--allow-request-overrides`` appended when its command lacks it. ``base_urls`` maps an arm to a server
already running with that arm's configuration (and the flag). Other engines: the token-level probe.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from abbench.client import EngineClient
from abbench.diagnostics.diff import pick_round, usable
from abbench.errors import ConfigError
from abbench.diagnostics.layertrace import LayerProbe, compare_traces
from abbench.diagnostics.probe import recorded_prompt_ids
from abbench.profile import Profile, RequestSpec, profile_from_dict
from abbench.results import RunRecord
from abbench.services import Service

OVERRIDES_FLAG = "--allow-request-overrides"


@contextmanager
def serving(profile: Profile, arm: str, client: EngineClient, base_url: str | None = None) -> Iterator[str]:
    """The base URL of a server for ``arm``: ``base_url``, the arm's own ``base_url``, or its service
    launched from the profile (with :data:`OVERRIDES_FLAG`) and stopped on exit."""
    spec, ae = profile.launch_spec(arm), profile.arm_engine(arm)
    if base_url or spec.base_url:
        yield str(base_url or spec.base_url)
        return
    if not spec.argv:
        raise ConfigError(f"arm {arm} has no command to launch; pass its server's URL")
    argv = list(spec.argv) + ([] if OVERRIDES_FLAG in spec.argv else [OVERRIDES_FLAG])
    log_dir = Path(tempfile.mkdtemp(prefix="abbench-layers-"))
    svc = Service.launch(f"layers-{arm}", argv, env=spec.env, log_path=log_dir / f"{arm}.log",
                         health_path=ae.health_path, health_timeout_s=profile.engine.health_timeout_s,
                         stop_timeout_s=profile.engine.stop_timeout_s, health_check=client.health,
                         profile_dir=spec.profile_dir, arms=[arm])
    try:
        yield svc.base_url
    finally:
        svc.stop()


def engine_field(client: EngineClient, url: str, profile: Profile, arm: str, history: list[int],
                 request: RequestSpec, ask: str, field: str) -> tuple[Any, Any]:
    """Send ``history`` to ``arm``'s server at ``url`` with its request fields and ``ask: true`` (a vendored-engine
    request field); (the completion, its ``abbench.<field>``), or ConfigError where the server returned none: it
    must be the vendored engine or the transformers reference, started with :data:`OVERRIDES_FLAG`."""
    ae = profile.arm_engine(arm)
    c = client.complete(url, history, request=request, extra={**profile.arm(arm).request, ask: True},
                        target_prompt_tokens=len(history), model=ae.model, adapter=ae.adapter)
    value = (c.engine or {}).get(field)
    if not value:
        raise ConfigError(f"arm {arm}'s server returned no abbench.{field}: it must be the vendored engine or the "
                          f"transformers reference, started with {OVERRIDES_FLAG}")
    return c, value


def _history(record: RunRecord, profile: Profile, prompt_id: str, position: int, round_no: int | None,
             ref: str) -> list[int]:
    if prompt_id not in {p.id for p in record.prompts}:
        raise ConfigError(f"--prompt: run {record.run_id} has no prompt {prompt_id!r}; its prompts are "
                          f"{', '.join(p.id for p in record.prompts)}")
    ids = recorded_prompt_ids(record, profile, prompt_id)
    if position == 0:
        return ids
    samples = pick_round([s for s in record.samples if s.prompt_id == prompt_id and s.arm == ref and usable(s)],
                         round_no)
    if not samples:
        raise ConfigError(f"--position {position}: the reference arm {ref} has no ok sample of {prompt_id} with ids")
    out = samples[min(samples)].output_ids
    if position > len(out):
        raise ConfigError(f"--position {position}: the reference generated only {len(out)} ids")
    return ids + list(out[:position])


def probe_layers(record: RunRecord, prompt_id: str, arm: str, *, position: int = 0, round: int | None = None,
                 base_urls: dict[str, str] | None = None) -> LayerProbe:
    """Trace ``arm`` and the reference on the same history and compare them layer by layer (module
    docstring)."""
    profile = profile_from_dict(record.profile, where=f"run {record.run_id} profile")
    names = [a.name for a in profile.arms]
    if arm not in names:
        raise ConfigError(f"--arm: run {record.run_id} has no arm {arm!r}; its arms are {', '.join(names)}")
    ref = profile.arm(arm).parity_reference or profile.parity_reference_arm  # its own, else the run's
    if arm == ref:
        raise ConfigError(f"--arm {arm} is the reference arm; probe another arm against it")
    for name in (ref, arm):
        if profile.arm_engine(name).adapter != "openai":
            raise ConfigError(f"--layers: arm {name} uses adapter {profile.arm_engine(name).adapter!r}; layer traces "
                              "come from the vendored engine or the transformers reference (adapter openai). Use "
                              "the token-level probe (without --layers)")
    history = _history(record, profile, prompt_id, position, round, ref)
    request = RequestSpec(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2, stream=False,
                          timeout_s=profile.request.timeout_s, extra=dict(profile.request.extra))
    got: dict[str, tuple[list, int, list | None]] = {}
    with EngineClient() as client:
        for name in (ref, arm):
            ae = profile.arm_engine(name)
            with serving(profile, name, client, (base_urls or {}).get(name)) as url:
                if ae.reset_path:
                    client.reset(url, ae.reset_path)
                c, trace = engine_field(client, url, profile, name, history, request, "trace_layers", "layer_trace")
                got[name] = (trace, c.output_ids[0], c.logprobs[0] if c.logprobs else None)
    notes = []
    if position:
        notes.append(f"the history (prompt + {position} reference ids) is prefilled here in one request, while the "
                     "run decoded the output ids one at a time: the traced state is the prefill's, which can differ "
                     "in its last bits from the run's decode state")
    if any((r.get("block") == "router") for r in got[arm][0]) != any(r.get("block") == "router" for r in got[ref][0]):
        notes.append("one side traces router ids and the other does not (the transformers reference has none)")
    return LayerProbe(prompt_id=prompt_id, arm=arm, reference=ref, position=position, n_tokens=len(history),
                      rows=compare_traces(got[ref][0], got[arm][0]), ref_choice=got[ref][1],
                      arm_choice=got[arm][1], ref_top=got[ref][2], arm_top=got[arm][2], notes=notes)
