"""The forced-continuation probe (``abbench probe``): it launches an arm's service as the runner would.

:func:`probe_prompt` feeds an engine the prompt followed by the reference's own ids, one position at a time
(prompt + ref[:i] -> 1 token with top-k logprobs, i = 0..N-1; no engine here returns logprobs for echoed
prompt tokens in a form all adapters share, so it is step by step), and compares the logprobs the engine
gives at each position with the ones the reference captured. It reports the first position where they
differ by more than a threshold and the first position where the probed engine, given the reference's
history, would choose another token, with both top-2 margins. Because the history is the reference's, a
difference can only come from the arm's arithmetic, not from an earlier different token. The caller
supplies a running server (``base_url``) or lets :func:`probe_prompt` launch the arm's service as the runner
would (:meth:`abbench.profile.Profile.launch_spec`). The service's prefix cache is reset once before the
probe and then left alone, so step i reuses the KV of prompt + ref[:i-1] and computes one new position, as
in the arm's own decode (``reset_each=True`` resets before every step: each step then prefills the whole
history). Its result (:class:`~abbench.diagnostics.diff.ProbeResult`) and rendering
(:func:`~abbench.diagnostics.diff.format_probe`) are pure, in :mod:`abbench.diagnostics.diff`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from abbench import auth
from abbench.analysis import compare_ids
from abbench.client import EngineClient
from abbench.diagnostics.diff import (
    DEFAULT_PROBE_THRESHOLD,
    ProbeResult,
    ProbeStep,
    logprob_delta,
    pick_round,
    usable,
)
from abbench.errors import ConfigError, RequestError
from abbench.profile import Profile, RequestSpec, profile_from_dict
from abbench.results import RunRecord
from abbench.runner.run import prepare, run_credentials
from abbench.runner.slot import health_check

__all__ = ["ProbeResult", "ProbeStep", "logprob_delta", "probe_prompt", "recorded_prompt_ids"]
from abbench.services import Service


def recorded_prompt_ids(record: RunRecord, profile: Profile, prompt_id: str) -> list[int]:
    """The token ids of a run's prompt, rebuilt now with the run's profile; ConfigError when the rebuilt text is
    not the recorded one (the tokenizer or the corpus changed since the run)."""
    tok, built = prepare(profile)
    prompt = next(b for b in built if b.record.id == prompt_id)
    recorded = next(p for p in record.prompts if p.id == prompt_id)
    if prompt.record.sha256 != recorded.sha256:
        raise ConfigError(f"prompt {prompt_id} rebuilt now differs from the run's (sha256 {prompt.record.sha256[:12]} "
                          f"vs {recorded.sha256[:12]}): tokenizer or corpus changed")
    return list(tok.encode(prompt.text, add_special_tokens=True))


def probe_prompt(
    record: RunRecord,
    prompt_id: str,
    arm: str,
    *,
    base_url: str | None = None,
    round: int | None = None,
    positions: int | None = None,
    threshold: float = DEFAULT_PROBE_THRESHOLD,
    reset_each: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ProbeResult:
    """Forced-continuation probe of ``arm`` on ``prompt_id`` against the reference's own output (module
    docstring). ``base_url``: a server already running the arm's configuration; None launches the arm's
    service from the recorded profile and stops it afterwards. ``positions``: probe only the first N."""
    profile = profile_from_dict(record.profile, where=f"run {record.run_id} profile")
    names = [a.name for a in profile.arms]
    if arm not in names:
        raise ConfigError(f"--arm: run {record.run_id} has no arm {arm!r}; its arms are {', '.join(names)}")
    ref = profile.arm(arm).parity_reference or profile.parity_reference_arm  # its own, else the run's
    ref_samples = pick_round([s for s in record.samples if s.prompt_id == prompt_id and s.arm == ref and usable(s)],
                        round)
    if prompt_id not in {p.id for p in record.prompts}:
        raise ConfigError(f"--prompt: run {record.run_id} has no prompt {prompt_id!r}; its prompts are "
                          f"{', '.join(p.id for p in record.prompts)}")
    if not ref_samples:
        raise ConfigError(f"the reference arm {ref} has no ok sample with token ids of prompt {prompt_id}")
    r = min(ref_samples)
    s_ref = ref_samples[r]
    if not s_ref.logprobs:
        raise ConfigError(f"the reference's sample of {prompt_id} captured no logprobs (request.logprobs): "
                          "nothing to compare the probe with")
    free_first = free_id = None
    arm_sample = pick_round([s for s in record.samples if s.prompt_id == prompt_id and s.arm == arm and usable(s)], r)
    if r in arm_sample:
        _, free_first, _ = compare_ids(arm_sample[r].output_ids, s_ref.output_ids, 1)
        if free_first is not None and free_first < len(arm_sample[r].output_ids):
            free_id = arm_sample[r].output_ids[free_first]

    prompt_ids = recorded_prompt_ids(record, profile, prompt_id)
    ref_ids = list(s_ref.output_ids)
    n = len(ref_ids) if positions is None else min(positions, len(ref_ids))
    k = max(2, profile.request.logprobs or 2)
    request = RequestSpec(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=k, stream=False,
                          timeout_s=profile.request.timeout_s, extra=dict(profile.request.extra))
    extra = dict(profile.arm(arm).request)

    spec, ae = profile.launch_spec(arm), profile.arm_engine(arm)
    creds = run_credentials(profile)
    headers = creds.headers(spec.api_key_env)
    svc: Service | None = None
    steps: list[ProbeStep] = []
    with EngineClient(verify=auth.tls_verify(profile.ca_bundle_path())) as client:
        try:
            if base_url is None:
                if spec.base_url:
                    base_url = spec.base_url
                else:
                    if not spec.argv:
                        raise ConfigError(f"arm {arm} has no command to launch; pass --base-url")
                    log_dir = Path(tempfile.mkdtemp(prefix="abbench-probe-"))
                    svc = Service.launch(f"probe-{arm}", spec.argv, env=spec.env, log_path=log_dir / f"{arm}.log",
                                         health_path=ae.health_path,
                                         health_timeout_s=profile.engine.health_timeout_s,
                                         stop_timeout_s=profile.engine.stop_timeout_s,
                                         health_check=health_check(client, ae.health_path, creds,
                                                                   spec.api_key_env, spec.api_key_field),
                                         profile_dir=spec.profile_dir, arms=[arm])
                    base_url = svc.base_url
            reset = ae.reset_path
            for i in range(n):
                history = prompt_ids + ref_ids[:i]
                try:
                    if reset and (i == 0 or reset_each):
                        client.reset(base_url, reset, headers=headers)
                    c = client.complete(base_url, history, request=request, extra=extra,
                                        target_prompt_tokens=len(history), model=ae.model,
                                        adapter=ae.adapter, headers=headers)
                except RequestError as e:
                    if auth.is_auth_failure(e):
                        raise auth.auth_failure(e, spec.api_key_env, spec.api_key_field, creds) from None
                    raise RequestError(e.kind, creds.redact(e.detail), status=e.status) from None
                top = c.logprobs[0] if c.logprobs else None
                ref_top = [(int(t), float(v)) for t, v in s_ref.logprobs[i]] if i < len(s_ref.logprobs) else None
                steps.append(ProbeStep(i, ref_ids[i], ref_top, c.output_ids[0], top, logprob_delta(top, ref_top)))
                if progress is not None:
                    progress(i + 1, n)
        finally:
            if svc is not None:
                svc.stop()
    return ProbeResult(prompt_id=prompt_id, arm=arm, reference=ref, ref_round=r, base_url=base_url or "",
                       threshold=threshold, steps=steps, free_run_divergence=free_first, free_run_arm_id=free_id,
                       reset_each=reset_each)
