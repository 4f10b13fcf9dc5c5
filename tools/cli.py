"""`concordia`: the application-side command line (the fault-tolerant demo)."""

from __future__ import annotations

import os
import sys

import click

from concordia import __version__

from .common import EXIT_OK, EXIT_PROBLEMS, FiniteRange, OneLineGroup, emit_json, guarded


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="concordia")
def main():
    """Concordia: exact GPU state back after a crash."""


class _KillAt(click.ParamType):
    name = "STEP|random"

    def convert(self, value, param, ctx):
        if value == "random" or isinstance(value, int):
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a step number nor 'random'", param, ctx)


@main.command()
@click.option("--log", "log", default="file:./concordia-data/demo.log", show_default=True,
              help="Log to checkpoint into (file:PATH, shm:NAME, pmem:PATH, dax:/dev/daxX.Y); "
                   "formatted afresh, left in place afterwards.")
@click.option("--steps", default=160, show_default=True, type=click.IntRange(2, None),
              help="Decode steps of the whole run.")
@click.option("--kill-at", default="random", show_default=True, type=_KillAt(),
              help="Step after which the worker is SIGKILLed (random: between two checkpoints).")
@click.option("--every", default=4, show_default=True, type=click.IntRange(1, None),
              help="Checkpoint every N steps.")
@click.option("--seed", default=0, show_default=True, help="Seed of the model weights and requests.")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
              help="Where the model runs (auto: the GPU when CuPy finds one).")
@click.option("--model", type=click.Choice(["qwen3"]), default=None,
              help="Protect a Hugging Face transformers Qwen3 (random weights from a config: the 0.6B "
                   "shape on a GPU, a tiny shape on the CPU) with a StaticCache and an online LoRA "
                   "adapter, checkpointed from inside generate(), instead of the reference workload.")
@click.option("--force", is_flag=True,
              help="Format --log even when it holds something other than a Concordia log.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@guarded
def demo(log, steps, kill_at, every, seed, device, model, force, as_json):
    """Run a decode loop, SIGKILL it, recover it from the log in a fresh
    process and check the result is bit-identical to an uninterrupted run.
    --log is formatted afresh: a Concordia log there is replaced, anything
    else is refused (exit 2, left unchanged) unless --force.

    Prints the recovery timeline (detect, isolate, restore, reintegrate) and
    the bytes moved.  Exit 0 when bit-identical, 1 when not.

    Example:

    \b
        concordia demo --steps 96 --kill-at 41
        concordia-wal info file:./concordia-data/demo.log
        concordia demo --model qwen3 --steps 32 --every 4
    """
    if model is not None:
        _model_demo(log, steps, kill_at, every, seed, device, force, as_json)
        return
    from concordia.demo import format_report, run_demo

    progress = None if as_json else (lambda msg: click.echo(f"... {msg}", err=True))
    rep = run_demo(log=log, steps=steps, kill_at=kill_at, seed=seed, every=every, device=device,
                   progress=progress, force=force)
    if as_json:
        emit_json(rep)
    else:
        click.echo(format_report(rep))
    sys.exit(EXIT_OK if rep["identical"] else EXIT_PROBLEMS)


def _model_demo(log, steps, kill_at, every, seed, device, force, as_json):
    import random

    from concordia.wal.volume import check_format_target

    from concordia.demo.model import format_report, pick_kill_at, run_demo
    from concordia.regions.errors import DemoError

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise DemoError(f"--model needs torch and transformers ({exc.name} is missing)", where="demo",
                        hint="pip install transformers peft") from None
    if device == "auto":
        device = "gpu" if torch.cuda.is_available() else "cpu"
    if device == "gpu" and not torch.cuda.is_available():
        raise DemoError("--device gpu: torch sees no CUDA device", where="demo")
    # --kill-at N: SIGKILLed after step N, as in the reference demo; the model
    # demo's worker counts the step it is killed in, before that step's work
    if kill_at == "random":
        kill_at = pick_kill_at(steps, every, random.Random(seed))
    else:
        if not 1 <= kill_at <= steps - 1:
            raise DemoError(f"--kill-at {kill_at} must lie in [1, {steps - 1}]", where="demo")
        kill_at += 1
    for target in (log, log + ".ref"):  # the demo replaces its own logs, and nothing else
        check_format_target(target, overwrite=force, allow_log=True, hint="pass --force to format it anyway")
    on_gpu = device == "gpu"
    rep = run_demo(log, shape="0.6b" if on_gpu else "tiny", device="cuda" if on_gpu else "cpu",
                   steps=steps, every=every, kill_at=kill_at, batch=8 if on_gpu else 2,
                   prompt_len=64 if on_gpu else 8, size=(4 << 30) if on_gpu else (64 << 20),
                   segment=(64 << 20) if on_gpu else (8 << 20), seed=seed)
    if as_json:
        emit_json(rep)
    else:
        click.echo(format_report(rep))
    sys.exit(EXIT_OK if rep["identical"] else EXIT_PROBLEMS)


def _hook(text: str | None, what: str):
    """`MODULE:FUNCTION` -> the function (a one-line usage error otherwise)."""
    if not text:
        return None
    import importlib

    mod, sep, fn = text.partition(":")
    if not sep or not mod or not fn:
        raise click.BadParameter(f"{text!r} is not MODULE:FUNCTION", param_hint=what)
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as exc:
        raise click.BadParameter(f"cannot load {text!r}: {exc}", param_hint=what) from None


@main.command()
@click.argument("log")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
              help="Where to restore (auto: the GPU when CuPy finds one).")
@click.option("--gpu", "gpu", type=click.IntRange(min=0), default=None,
              help="The GPU to stand by on (a spare one; default: the current device).")
@click.option("--lease", "lease_s", type=FiniteRange(min=0, min_open=True), default=None,
              help="Also watch the primary's heartbeat; a beat older than this many seconds counts "
                   "as a hung primary, which is SIGKILLed.  Default: the writer lock alone.")
@click.option("--model", "model", metavar="MODULE:FUNCTION", default=None,
              help="Called as FUNCTION(standby) while warming; its result is standby.model.")
@click.option("--resume", "resume", metavar="MODULE:FUNCTION", default=None,
              help="Called as FUNCTION(takeover) after the restore, to carry on.")
@click.option("--timeout", type=FiniteRange(min=0), default=None,
              help="Give up (exit 2) when the primary still holds the log after this many seconds.")
@click.option("--hold", is_flag=True,
              help="After taking over, keep the log (and its writer lock) until interrupted, as the "
                   "new primary, so that other standbys keep waiting behind this one.")
@click.option("--follow", is_flag=True,
              help="A hot standby: apply each epoch the primary commits, as it is written, to a mirror of "
                   "the state on the standby's device, and take over from it (the epochs since the last look "
                   "only), with no restore from the log.")
@click.option("--lock-first", is_flag=True,
              help="With --follow: hand the state to --resume only once the primary's writer lock is held "
                   "and the log opened (for a --resume whose first step must not run before), not as soon "
                   "as every thread of the primary is exiting.")
@click.option("--json", "as_json", is_flag=True, help="Print the takeover as JSON.")
@guarded
def standby(log, device, gpu, lease_s, model, resume, timeout, hold, follow, lock_first, as_json):
    """Stand by for the process writing LOG: open and map the log, register it
    with the GPU, compile the kernels, rehearse a restore, load the model; then
    wait for the primary to die (its writer lock comes free, or with --lease
    its heartbeat stops), take the writer lock, restore the last committed
    epoch and hand it to --resume.  Prints the timeline (detect, isolate,
    restore, reintegrate).  A log no process holds is taken over at once.
    With --follow the mirror's epoch is handed to --resume as soon as every
    thread of the primary is exiting; the lock and the open that cuts its
    tail follow beside it, before anything is written (the timeline's
    confirm line).

    Exit 0 after a takeover; 1 when recovery of the log refuses (damage
    before its last commit); 2 on a usage or I/O error, or --timeout.

    Example:

    \b
        concordia standby hugetlb:/mnt/huge/kv.log --resume myapp.serve:resume --json
        concordia standby shm:kv.log --follow --json
    """
    import signal

    from concordia.standby import Standby, format_timeline

    progress = lambda msg: click.echo(f"standby: {msg}", err=True)  # noqa: E731
    if lock_first and not follow:
        raise click.BadParameter("is for a hot standby: pass --follow too", param_hint="--lock-first")
    sb = Standby(log, device=device, gpu=gpu, lease_s=lease_s, load_model=_hook(model, "--model"), progress=progress,
                 follow=follow, early=not lock_first)
    resume_fn = _hook(resume, "--resume")
    try:
        tk = sb.run(resume_fn, timeout=timeout)
    finally:
        sb.close()
    try:
        rep = {"log": log, "warm": sb.warm_report, **tk.to_json()}
        if as_json:
            emit_json(rep)
        else:
            click.echo(format_timeline(tk))
        sys.stdout.flush()
        if hold:
            signal.signal(signal.SIGTERM, lambda *a: sys.exit(EXIT_OK))
            progress(f"holding the log as its writer (pid {os.getpid()}); interrupt to give it back")
            try:
                while True:
                    signal.pause()
            except KeyboardInterrupt:
                sys.exit(EXIT_OK)
    finally:
        tk.close()


if __name__ == "__main__":
    main()
