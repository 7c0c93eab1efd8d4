"""Result validation on the rank side (opt-in): a suspicious result (NaN, Inf, a loss
spike) is re-run in place, from the state captured before the step, and what the re-run
gives decides: a transient fault of this node (recorded, training goes on), a persistent
one (the last good state checkpointed, exit 16: the daemon re-runs on other nodes), or,
in that disambiguation run, the model's (exit 17) or a correct result. The rules and their
table: `ftslurm.agent.validation_rules`; docs/agent.md#result-validation.

    agent = fta.init()
    check = agent.validation(checkpoint=save_last_good)    # once; settings optional
    for step in range(start, total):
        state = capture()                      # RNG, data position (the model and the
        while True:                            # optimizer do not change before the update)
            loss = forward_backward(step)
            if agent.validate(loss, step) is fta.GO_ON:
                break
            restore(state)                     # re-run in place (zero the gradients too)
        optimizer.step()

or `check.run_step(step, fn, capture, restore)`, which is that loop. `validate` is a
collective: every rank calls it at every step, and every rank gets the same answer (a
re-run, go on, or the same exit). Exit 16 and 17 leave through the rank agent's exit
path (`RankAgent.exit`); they never return.

Each rank writes what it saw to `RunDir.validation` (its counts and events), which
`ftslurm status` and `ftslurm report` show. Fault injection: FTSLURM_INJECT's
`nan@T[:RANK[:persistent]]` and `spike@...` spoil the value this rank validates (never
the training state), so a re-run in place differs (transient) or reproduces (persistent).
"""

from __future__ import annotations

import math
import os
import random
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from ftslurm.agent import validation_rules as rules
from ftslurm.agent.validation_rules import Action, Finding, Recent, Settings, Suspect, Verdict
from ftslurm.core.contract import ExitCode, JobEnv, RunDir
from ftslurm.core.contract.reports import Kind, ValidationEvent, ValidationReport
from ftslurm.core.inject import Injection, parse_injection
from ftslurm.errors import ConfigError
from ftslurm.fsutil import read_json, write_json_atomic
from ftslurm.runfiles import rank_reports, read_reports, write_report


def _text(value: float) -> str:
    return repr(value) if math.isfinite(value) else str(value)


def _number(result: Any) -> float:
    """A result as a float (a tensor's one element, without its autograd graph)."""
    detach = getattr(result, "detach", None)
    return float(detach().item() if detach is not None else result)


def _max_over_ranks(value: int) -> int:
    """`value`'s maximum over the ranks of the default process group (one all-reduce; the
    value itself without one)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return value
    if not (dist.is_available() and dist.is_initialized()):
        return value
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    tensor = torch.tensor([value], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


class Validator:
    """One rank's result validation (the module doc). `checkpoint`: saves the last good
    state before an exit 16 (every rank calls it: it may be a collective); `leave`: ends
    the process with a code (the rank agent's exit); `started`: the clock's reading the
    injections' times count from."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        checkpoint: Callable[[], None] | None = None,
        leave: Callable[[int], NoReturn] | None = None,
        environ: dict[str, str] | None = None,
        started: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        collective: Callable[[int], int] = _max_over_ranks,
    ) -> None:
        env = dict(os.environ if environ is None else environ)
        job = JobEnv.from_environ(env)
        self.settings = settings if settings is not None else Settings()
        self.rank = int(env.get("RANK", "0"))
        self.node = env.get("SLURMD_NODENAME") or socket.gethostname()
        self.job_id = env.get("SLURM_JOB_ID")
        self.attempt = job.attempt or 0
        self.run: RunDir | None = job.run
        self.context = job.disambiguate
        self._checkpoint = checkpoint
        self._leave = leave
        self._clock = clock
        self._started = clock() if started is None else started
        self._collective = collective
        self.recent = Recent()
        self.suspect: Suspect | None = None
        self.checks = self.reruns = self.differed = 0
        self.events: list[ValidationEvent] = []
        self._dirty = False
        self._suspect_steps: tuple[int, ...] | None = None
        self.injections = self._injections(job.inject)
        self._fired: set[str] = set()
        self._spoiled: dict[str, str] = {}
        if self.injections and self.run is not None:
            self._fired = set(read_json(self.run.fired(self.rank)) or [])
            for report in rank_reports(self.run, self.rank):
                self._fired.update(report.injected)
            found = read_json(self.run.result_fault_nodes)
            self._spoiled = dict(found) if isinstance(found, dict) else {}

    @staticmethod
    def _injections(value: str | None) -> tuple[Injection, ...]:
        found = []
        for spec in (value or "").split(","):
            try:
                injection = parse_injection(spec) if spec.strip() else None
            except ConfigError:  # the task wrapper reports it
                continue
            if injection is not None and injection.kind.on_result:
                found.append(injection)
        return tuple(found)

    # ------------------------------------------------------------------ the check
    def validate(self, result: Any, step: int) -> Action:
        """Check this rank's `result` of `step` (a number or a one-element tensor): GO_ON
        (apply the step) or RERUN (restore the state from before the step and run it
        again, then call `validate` again with the re-run's result). The same answer on
        every rank (a collective). Exit 16 or 17 never return."""
        rerun = self.suspect is not None and self.suspect.step == step
        value = self._spoil(_number(result), rerun)
        if not rerun:
            self.suspect = None
            self.checks += 1
            finding = rules.check(value, self.recent, self.settings)
            wish = rules.first_action(finding, step, self.settings)
            if Action(self._collective(int(wish))) is Action.GO_ON:
                self.recent = self.recent.add(value, self.settings.window)
                return Action.GO_ON
            self.suspect = Suspect(
                step, value, Finding.SAMPLED if finding is Finding.OK else finding
            )
            self.reruns += 1
            self._dirty = True
            return Action.RERUN
        first = self.suspect
        finding = rules.check(value, self.recent, self.settings)
        differed = not rules.same(first.value, value)
        verdict = rules.classify(first, value, finding, self.settings, self._disambiguating(step))
        action = Action(self._collective(int(rules.ACTION[verdict])))
        if differed:
            self.differed += 1
        if action is Action.RERUN:
            self.suspect = Suspect(first.step, first.value, first.finding, first.reruns + 1)
            self.reruns += 1
            return Action.RERUN
        self.suspect = None
        if verdict is not Verdict.OK or differed:
            self._event(first, value, verdict, action, differed)
        if action is Action.GO_ON:
            if finding is Finding.OK or verdict is Verdict.CORRECT:
                self.recent = self.recent.add(value, self.settings.window)
            return Action.GO_ON
        self.flush()
        if action is Action.EXIT_16:
            self._say(
                f"step {step}: result reproduced on this hardware: checkpointing the last good "
                "state, exit 16 (resume on other nodes)"
            )
            if self._checkpoint is not None:
                self._checkpoint()
        else:
            self._say(
                f"step {step}: result reproduced on other hardware: the model's, not the "
                "machine's: exit 17"
            )
        self._exit(
            ExitCode.RESUME_ELSEWHERE if action is Action.EXIT_16 else ExitCode.FAILED_VALIDATION
        )

    def run_step(
        self,
        step: int,
        fn: Callable[[], Any],
        capture: Callable[[], Any],
        restore: Callable[[Any], None],
    ) -> Any:
        """Run `fn` (the step's forward and backward: it returns the result to validate)
        until its result is accepted: `capture()` before it, `restore(state)` before each
        re-run in place. Returns the accepted result."""
        state = capture()
        while True:
            result = fn()
            if self.validate(result, step) is Action.GO_ON:
                return result
            restore(state)

    def _disambiguating(self, step: int) -> bool:
        if self.context is None:
            return False
        if self._suspect_steps is None:
            found: list[int] = []
            if self.run is not None:
                for report in read_reports(self.run, Kind.VALIDATION, self.context.attempt):
                    found += [
                        e.step
                        for e in report.events
                        if e.verdict == Verdict.PERSISTENT.value and e.step is not None
                    ]
            self._suspect_steps = tuple(sorted(set(found)))
        return rules.disambiguated_step(step, True, self._suspect_steps)

    # ------------------------------------------------------------------ injection
    def _spoil(self, value: float, rerun: bool) -> float:
        if not self.injections:
            return value
        since = self._clock() - self._started
        for injection in self.injections:
            if not rules.fires(
                injection,
                rank=self.rank,
                node=self.node,
                since_start_s=since,
                fired=self._fired,
                spoiled=self._spoiled,
                warm=len(self.recent.values) >= self.settings.warmup,
                rerun=rerun,
            ):
                continue
            self._record_fired(injection)
            return rules.corrupt(value, injection)
        return value

    def _record_fired(self, injection: Injection) -> None:
        """Noted before the value is spoiled (as the task wrapper's injections are)."""
        spec = injection.spec()
        if injection.persistent:
            if spec in self._spoiled:
                return
            self._spoiled[spec] = self.node
        elif spec in self._fired:
            return
        self._fired.add(spec)
        print(
            f"ftslurm: injected {spec} on rank {self.rank} (node {self.node})",
            file=sys.stderr,
            flush=True,
        )
        if self.run is None:
            return
        path = self.run.fired(self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, sorted(set(read_json(path) or []) | {spec}))
        if injection.persistent:
            known = read_json(self.run.result_fault_nodes)
            known = dict(known) if isinstance(known, dict) else {}
            if spec not in known:
                write_json_atomic(self.run.result_fault_nodes, {**known, spec: self.node})

    # ------------------------------------------------------------------ records
    def _event(
        self, first: Suspect, rerun: float, verdict: Verdict, action: Action, differed: bool
    ) -> None:
        self.events.append(
            ValidationEvent(
                step=first.step,
                kind=first.finding.value,
                verdict=verdict.value,
                action=action.word,
                value=_text(first.value),
                rerun=_text(rerun),
                reruns=first.reruns + 1,
                differed=differed,
                time=time.time(),
            )
        )
        if verdict is not Verdict.OK:
            self._say(
                f"step {first.step}: {first.finding.value} result ({_text(first.value)}) re-run "
                f"in place: {_text(rerun)}: {verdict.value}"
                + (f" (node {self.node})" if verdict is Verdict.TRANSIENT else "")
            )
        self.flush()

    def report(self) -> ValidationReport:
        return ValidationReport(
            rank=self.rank,
            node=self.node,
            attempt=self.attempt,
            job_id=self.job_id,
            mode=self.settings.mode.value,
            checks=self.checks,
            reruns=self.reruns,
            differed=self.differed,
            events=list(self.events),
        )

    def flush(self) -> None:
        """Write this rank's report (`RunDir.validation`) when it changed since the last."""
        if self.run is None or not (self._dirty or self.events or self.reruns):
            return
        self._dirty = False
        write_report(self.run.validation(self.attempt, self.rank), self.report())

    def _say(self, line: str) -> None:
        print(f"ftslurm: rank {self.rank}: {line}", file=sys.stderr, flush=True)

    def _exit(self, code: int) -> NoReturn:
        if self._leave is not None:
            self._leave(code)
        from ftslurm.agent import rank as fta

        fta.leave(code)
        raise AssertionError("not reached")  # pragma: no cover


# ---------------------------------------------------------------------- RNG (Training)
def capture_rng() -> dict[str, Any]:
    """The random generators' states as they are (cheap: no conversion), for a re-run in
    place: python's, torch's CPU one, numpy's global one (when imported) and CUDA's (when
    initialised)."""
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
