"""``autopart profile``: capture a model, profile it (measured or analytical) and print a table."""

from __future__ import annotations

import difflib
import importlib.util
import json
from pathlib import Path
from typing import Any

import typer

from autopart.core.errors import UsageError

__all__ = ["profile", "build_model", "parse_device"]

_DTYPES = ("float32", "bfloat16")


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_device(device: str) -> tuple[str, Any]:
    """``("measured", "cpu" | "cuda:N")`` or ``("analytical", DeviceSpec)``.

    ``cpu`` and ``cuda[:N]`` (any case) are measured on this machine; any other text is a
    device preset under any name it accepts (``h100``, ``A100-80GB``,
    ``"NVIDIA H100 80GB HBM3"``; see ``autopart devices``).

    Raises:
        UsageError: unknown preset (with the closest names), malformed device, or CUDA
            without a GPU.
    """
    from autopart.core.cluster import device_preset
    from autopart.core.errors import PlanError, ProfileError
    from autopart.profiler.timer import check_device

    text = device.strip()
    if text.lower() == "cpu" or text.lower().startswith("cuda"):
        try:
            check_device(text.lower())
        except ProfileError as exc:
            raise UsageError(f"--device {device!r}: {exc}; or a device preset for an "
                             "analytical profile (`autopart devices` lists them)") from None
        return "measured", text.lower()
    try:
        return "analytical", device_preset(text)
    except PlanError as exc:
        raise UsageError(f"--device: {exc}; or cpu / cuda:N to measure on this machine"
                         ) from None


def build_model(spec: str, config: list[str], batch_size: int, seq_len: int, *, meta: bool,
                ) -> tuple[Any, tuple[Any, ...]]:
    """Build ``hf:<Class>`` from its config class (random weights) or call ``file.py:function``.

    Raises:
        UsageError: unknown class, config key or file/function.
    """
    import torch

    if spec.startswith("hf:"):
        import transformers

        name = spec[3:]
        cls = getattr(transformers, name, None) if name.isidentifier() else None
        config_cls = getattr(cls, "config_class", None)
        if cls is None or config_cls is None:
            names = [n for n in dir(transformers) if n.endswith(("Model", "LMHeadModel", "ForCausalLM"))]
            close = difflib.get_close_matches(name, names, n=6)
            raise UsageError(f"unknown transformers model class {name!r}; valid: a transformers "
                                  f"model class with a config class, e.g. {', '.join(close or names[:6])}")
        cfg = config_cls()
        for item in config:
            key, sep, value = item.partition("=")
            if not sep or not hasattr(cfg, key):
                valid = ", ".join(sorted(cfg.to_dict()))
                raise UsageError(f"--config {item!r}: {config_cls.__name__} has no key {key!r}; "
                                      f"valid keys: {valid}")
            try:
                setattr(cfg, key, _parse_value(value))
            except Exception as exc:  # the config class validates: its message, one line
                raise UsageError(f"--config {item!r}: {config_cls.__name__} refused it: "
                                 f"{_brief(exc)}; pass a value of the key's type") from None
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False
        try:
            if meta:
                with torch.device("meta"):
                    model = cls(cfg)
            else:
                torch.manual_seed(0)
                model = cls(cfg)
        except Exception as exc:  # a config the model cannot be built with
            raise UsageError(f"{name}({config_cls.__name__} with --config {config}) could not be "
                             f"built: {_brief(exc)}; fix the --config values") from None
        vocab = int(getattr(cfg, "vocab_size", 2) or 2)
        device = "meta" if meta else "cpu"
        x = torch.randint(0, vocab, (batch_size, seq_len), device="cpu").to(device)
        return model.train(), (x,)
    path, sep, func = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not Path(path).is_file():
        raise UsageError(f"MODEL {spec!r}: valid forms are hf:<transformers model class> or "
                              "path/to/file.py:function")
    mod_spec = importlib.util.spec_from_file_location("_autopart_user_model", path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: name it and its error on one line
        raise UsageError(f"{path}: importing it failed: {_brief(exc)}; fix the file") from None
    fn = getattr(module, func, None)
    if fn is None or not callable(fn):
        funcs = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        raise UsageError(f"{path} has no function {func!r}; valid: {', '.join(funcs)}")
    try:
        out = fn()
    except Exception as exc:
        raise UsageError(f"{spec}: calling it failed: {_brief(exc)}; fix the function") from None
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise UsageError(f"{spec} returned {type(out).__name__}; it must return "
                         "(model, example_inputs)")
    model, inputs = out
    return model, inputs if isinstance(inputs, tuple) else (inputs,)


def _brief(exc: BaseException) -> str:
    """``Type: message`` on one line (at most 300 characters)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def _table(costs: Any, depth: int, top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    groups: dict[str, list[float]] = {}
    for n in costs.nodes:
        key = ".".join(n.module_path.split(".")[:depth]) or "<top>"
        g = groups.setdefault(key, [0.0, 0.0, 0.0, 0.0])
        g[0] += n.fwd_us + n.bwd_us
        g[1] += n.flops
        g[2] += n.saved_bytes
        g[3] += n.param_bytes
    table = Table(title=f"{costs.source}  batch {costs.batch_size}  ({len(costs.nodes)} nodes)")
    for col in ("module path", "fwd+bwd ms", "GFLOP (fwd)", "saved MB", "params MB"):
        table.add_column(col, justify="left" if col == "module path" else "right")
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    for key, (us, flops, saved, params) in rows[:top]:
        table.add_row(key, f"{us / 1e3:.3f}", f"{flops / 1e9:.3f}", f"{saved / 1e6:.2f}",
                      f"{params / 1e6:.2f}")
    if len(rows) > top:
        table.add_row(f"... {len(rows) - top} more", "", "", "", "")
    tot = [sum(g[i] for g in groups.values()) for i in range(4)]
    table.add_row("total", f"{tot[0] / 1e3:.3f}", f"{tot[1] / 1e9:.3f}", f"{tot[2] / 1e6:.2f}",
                  f"{tot[3] / 1e6:.2f}", style="bold")
    Console().print(table)


def profile(model: str = typer.Argument(..., help="hf:<transformers class> or file.py:function"),
            config: list[str] = typer.Option([], "--config", help="KEY=VALUE config override"),
            batch_size: int = typer.Option(1, min=1, help="batch size B (hf: models)"),
            seq_len: int = typer.Option(128, min=1, help="sequence length T (hf: models)"),
            dtype: str = typer.Option("float32", help="float32 or bfloat16"),
            device: str = typer.Option("cpu", help="cpu or cuda:N (measured), or a device preset "
                                        "such as h100 (analytical; `autopart devices`)"),
            out: Path = typer.Option(Path("profile.json"), help="CostGraph JSON to write"),
            depth: int = typer.Option(3, min=1, help="module-path components per table row"),
            top: int = typer.Option(25, min=1, help="table rows shown"),
            no_cache: bool = typer.Option(False, "--no-cache", help="ignore the profile cache"),
            ) -> None:
    """Profile a model's per-op costs and write its CostGraph JSON."""
    try:
        if dtype not in _DTYPES:
            raise UsageError(f"--dtype {dtype!r}; valid: {', '.join(_DTYPES)}")
        method, target = parse_device(device)
        net, inputs = build_model(model, config, batch_size, seq_len, meta=method == "analytical")
    except UsageError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    _run(net, inputs, method, target, dtype, out, depth, top, not no_cache)


def _run(net: Any, inputs: tuple[Any, ...], method: str, target: Any, dtype: str, out: Path,
         depth: int, top: int, use_cache: bool) -> None:
    import torch

    from autopart.core.capture import capture
    from autopart.core.progress import phase, progress
    from autopart.profiler import profile_analytical, profile_graph
    from autopart.profiler.analytical import ANALYTICAL_REVISION
    from autopart.profiler.cache import cached_profile, profile_key

    torch_dtype = getattr(torch, dtype)
    net = net.to(torch_dtype)
    with progress():  # the phases on stderr (autopart.core.progress)
        with phase("capture"):
            captured = capture(net, inputs)
        flat = captured.flatten_inputs(inputs, {})
        name = target.name if method == "analytical" else target
        key = profile_key(captured.fingerprint, name, flat, dtype=dtype, training=True,
                          method=f"analytical:{ANALYTICAL_REVISION}"
                          if method == "analytical" else method)
        with phase("profile") as shown:

            def compute() -> Any:
                if method == "analytical":
                    return profile_analytical(captured, flat, target, dtype=torch_dtype)
                return profile_graph(captured, flat, device=target, progress=shown.count)

            if use_cache:
                costs, hit = cached_profile(key, compute)
            else:
                costs, hit = compute(), False
            if hit:
                shown.note("from cache")
    _table(costs, depth, top)
    costs.save(out)
    typer.echo(f"wrote {out} ({'from cache, ' if hit else ''}{costs.profile_wall_s:.1f} s profiling)")
