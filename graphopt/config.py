"""Typed, frozen configuration parsed from ``torch.compile(..., options={...})``.

This module holds the global options; a pass's own options (``moe``, ``remat``,
``lightning``) are classes next to that pass, parsed through the pass registry
(:func:`graphopt.passes.option_keys`).

Every option is validated before any compile work starts (no tracing, no directory created
other than the dump directory), and an error names the bad key or value and the valid ones.
Options that later capabilities add (attention, moe, remat, parallel, cluster) are added here
only together with the pass that honours them, so an option never silently does nothing.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import numbers
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from graphopt.errors import ConfigError

LOWERING_NAMES = ("auto", "eager", "inductor", "npu")
ATTENTION_MODES = ("keep", "exact", "lightning")
DUMP_DIR_ENV = "GRAPHOPT_DUMP_DIR"


@dataclass(frozen=True)
class VerifyConfig:
    """What ``options={"verify": ...}`` checks after each compile.

    ``True`` enables it with per-dtype tolerances; a dict sets the fields below.
    """

    enabled: bool = False
    """Run eager and the transformed graphs on the sample inputs and compare them."""
    rtol: float | None = None
    """Relative tolerance; None picks one per dtype (see ``graphopt.verify.default_tolerance``)."""
    atol: float | None = None
    """Absolute tolerance; None picks one per dtype."""
    grads: bool = True
    """Also compare input and parameter gradients when the graph is compiled for training."""

    def __post_init__(self) -> None:
        for name in ("enabled", "grads"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"verify.{name} must be True or False, got "
                                  f"{getattr(self, name)!r}")
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not math.isfinite(value) or value < 0):
                raise ConfigError(f"verify.{name} must be a finite non-negative number, got "
                                  f"{value!r}")

    @classmethod
    def parse(cls, value: Any) -> VerifyConfig:
        if isinstance(value, VerifyConfig):
            return value
        if isinstance(value, bool):
            return cls(enabled=value)
        if isinstance(value, Mapping):
            _reject_unknown(value, {f.name for f in fields(cls)}, "verify")
            unused = sorted(k for k in value if k != "enabled")
            if value.get("enabled") is False and unused:
                raise ConfigError(f"verify.enabled=False turns verify off, so "
                                  f"{', '.join(unused)} would do nothing: drop them, or "
                                  "drop enabled=False")
            return cls(**{"enabled": True, **dict(value)})
        raise ConfigError(
            f"option 'verify' must be a bool or a dict with keys enabled, rtol, atol, grads; "
            f"got {type(value).__name__} {value!r}"
        )


@dataclass(frozen=True)
class GraphoptConfig:
    """All graphopt options. Build it with :meth:`from_options`.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, an unknown lowering or pass
            name, a dump directory that cannot be written.
        LoweringUnavailableError: ``lowering="npu"`` without torch_npu installed.
    """

    lowering: str = "auto"
    """"auto" | "eager" | "inductor" | "npu". auto: npu for NPU inputs, else inductor."""
    attention: str = "keep"
    """"keep": change nothing (sites are reported). "exact": rewrite code that already
    computes decayed causal linear attention (MiniMax's block loop, the parallel form) into
    graphopt::lightning_attention, numerics unchanged. "lightning": also replace causal
    softmax attention (SDPA) by Lightning Attention: APPROXIMATE, changes the model's function
    (for linearizing a pretrained model before fine-tuning); see ``lightning``."""
    pass_options: Mapping[str, Any] = field(default_factory=dict)
    """Options owned by passes, by option key (``options={"moe": {...}, "remat": {...}}``):
    each pass parses its own section (``GraphPass.options_cls``, found through the pass
    registry); ``enable: [name]`` means the same as ``name: {}``. See :attr:`moe`,
    :attr:`remat`."""
    dump_dir: Path | None = None
    """Write every graph before/after every pass and the report here (env GRAPHOPT_DUMP_DIR)."""
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    """Compare against eager after compiling; see :class:`VerifyConfig`."""
    disable: tuple[str, ...] = ()
    """Names of passes of the default pipeline to skip (``graphopt passes`` lists them)."""
    enable: tuple[str, ...] = ()
    """Names of registered passes outside the default pipeline to append to their stage."""
    inductor_config: Mapping[str, Any] = field(default_factory=dict)
    """Extra ``torch._inductor.config`` patches for the inductor lowering."""
    mode: str | None = None
    """torch.compile's ``mode`` (e.g. "max-autotune"); applied by the inductor lowering.
    torch.compile refuses ``mode=`` together with ``options=``, so with options it is the
    option ``"mode"`` (``graphopt.compile(model, mode=...)`` moves it there)."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_MODES:
            raise ConfigError(f"unknown attention mode {self.attention!r}; valid modes: "
                              f"{', '.join(ATTENTION_MODES)}")
        if self.lowering not in LOWERING_NAMES:
            raise ConfigError(
                f"unknown lowering {self.lowering!r}; valid lowerings: {', '.join(LOWERING_NAMES)}"
            )
        from graphopt.passes import default_pipeline_names, option_keys, registered_pass_names

        known = registered_pass_names()
        for option in ("disable", "enable"):
            for name in getattr(self, option):
                if name not in known:
                    raise ConfigError(
                        f"option '{option}' names unknown pass {name!r}"
                        f"{did_you_mean(name, known)}; registered passes: {', '.join(known)}"
                    )
        defaults = default_pipeline_names()
        owned = {name for key, name in option_keys().items() if key == name}
        for name in self.enable:
            if name in self.disable:
                raise ConfigError(f"pass {name!r} is named in both 'enable' and 'disable'; "
                                  "keep it in one of them")
            if name in defaults and name not in owned:
                raise ConfigError(
                    f"pass {name!r} already runs by default; 'enable' only adds passes outside "
                    "the default pipeline (use 'disable' to turn default passes off)"
                )
        if self.mode not in (None, "default"):
            from torch._inductor import list_mode_options

            try:
                list_mode_options(self.mode)
            except Exception as exc:
                raise ConfigError(f"unknown torch.compile mode {self.mode!r}: {exc}") from exc

    @property
    def moe(self) -> Any:
        """The moe pass's options (``MoEOptions``), None when MoE sites are only reported."""
        return self.pass_options.get("moe")

    @property
    def lightning(self) -> Any:
        """The attention pass's ``LightningOptions`` (how attention="lightning" converts
        softmax attention); the defaults when not given."""
        from graphopt.passes.attention.options import LightningOptions

        return self.pass_options.get("lightning") or LightningOptions()

    @property
    def remat(self) -> Any:
        """The remat pass's options (``RematOptions``), None when remat is off."""
        return self.pass_options.get("remat")

    @classmethod
    def from_options(
        cls, options: Mapping[str, Any] | GraphoptConfig | None = None, mode: str | None = None
    ) -> GraphoptConfig:
        """Parse and validate ``options`` (the dict given to ``torch.compile``)."""
        from graphopt.passes import option_keys

        if isinstance(options, GraphoptConfig):
            return options
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(f"graphopt options must be a dict such as {{'attention': "
                              f"'exact'}}; got {type(options).__name__} {options!r}")
        options = dict(options or {})
        valid = {f.name for f in fields(cls)} - {"pass_options"} | set(option_keys())
        _reject_unknown(options, valid, "graphopt")
        if options.get("mode") is not None:  # torch.compile refuses mode= with options=
            if mode is not None and options["mode"] != mode:
                raise ConfigError(f"mode is given twice ({mode!r} and option "
                                  f"{options['mode']!r}); give one")
            mode = options["mode"] if options["mode"] is None else \
                _expect(options["mode"], str, "mode")
        kwargs: dict[str, Any] = {"mode": mode}
        for name in ("lowering", "attention"):
            if name in options:
                kwargs[name] = _expect(options[name], str, name)
        dump = options.get("dump_dir", os.environ.get(DUMP_DIR_ENV) or None)
        if dump is not None:
            kwargs["dump_dir"] = _writable_dir(dump, from_env="dump_dir" not in options)
        if "verify" in options:
            kwargs["verify"] = VerifyConfig.parse(options["verify"])
        for name in ("disable", "enable"):
            if name in options:
                kwargs[name] = _names(options[name], name)
        if "inductor_config" in options:
            kwargs["inductor_config"] = _inductor_patches(options["inductor_config"])
        kwargs["pass_options"] = _pass_options(options, kwargs.get("enable", ()))
        config = cls(**kwargs)
        if "lightning" in options and config.attention != "lightning":
            raise ConfigError(f"option 'lightning' configures attention='lightning', but "
                              f"attention is {config.attention!r}; set attention='lightning' "
                              "or drop the 'lightning' options")
        if "attention" in options and config.attention != "keep" and \
                "attention" in config.disable:
            raise ConfigError(f"attention={config.attention!r} asks the attention pass to "
                              "rewrite, but 'attention' is in 'disable'; drop one of them")
        for key, pass_name in option_keys().items():
            if key in config.pass_options and pass_name in config.disable:
                raise ConfigError(f"option {key!r} is given but {pass_name!r} is in 'disable'; "
                                  "drop one of them")
        if config.mode not in (None, "default") and config.lowering in ("eager", "npu"):
            raise ConfigError(f"mode {config.mode!r} configures Inductor, but lowering is "
                              f"{config.lowering!r}, which does not use it: drop mode or use "
                              "lowering 'inductor' (or 'auto')")
        if config.inductor_config and config.lowering in ("eager", "npu"):
            raise ConfigError(f"option 'inductor_config' patches Inductor, but lowering is "
                              f"{config.lowering!r}, which does not use it: drop "
                              "inductor_config or use lowering 'inductor' (or 'auto')")
        if config.dump_dir is not None and \
                config.inductor_config.get("force_disable_caches") is False:
            where = "option 'dump_dir'" if "dump_dir" in options else \
                f"{DUMP_DIR_ENV} (environment)"
            raise ConfigError(f"inductor_config force_disable_caches=False with a dump "
                              f"directory ({where}): a cache hit skips the graphs a dump "
                              "holds (graphopt turns the caches off while dumping); drop one "
                              "of them")
        if config.lowering == "npu":
            from graphopt.lowering import require_npu

            require_npu()
        return config


def _pass_options(options: Mapping[str, Any], enable: Any) -> dict[str, Any]:
    """Each pass parses its own options section; ``enable: [name]`` means ``name: {}``."""
    from graphopt.passes import get_pass, option_keys

    parsed: dict[str, Any] = {}
    for key, pass_name in option_keys().items():
        parse = get_pass(pass_name).parse_options
        # None / False switch the pass off; 0 (== False in Python) is a value, and its parse
        # says what it must be (remat: 0 meant "no remat" silently, a review)
        if key in options and options[key] is not None and options[key] is not False:
            parsed[key] = parse(options[key])
        elif pass_name in enable and key == pass_name and key in options:  # (a review:
            # enable won, silently; a section of another name, 'lightning', is not the switch)
            raise ConfigError(f"options={{{key!r}: {options[key]!r}}} switches the {pass_name} "
                              f"pass off and enable: [{pass_name!r}] on: drop one of them")
        elif pass_name in enable and key == pass_name:
            try:
                parsed[key] = parse({})
            except ConfigError as exc:
                raise ConfigError(f"enable: [{pass_name!r}] means options={{{key!r}: {{}}}}, "
                                  f"which is incomplete: {exc}") from None
    return parsed


def parse_section(cls: Any, value: Any, name: str) -> Any:
    """An options section (``options[name]``): an instance of ``cls``, or a dict of its
    fields (unknown keys rejected with a did-you-mean)."""
    if isinstance(value, cls):
        return value
    keys = [f.name for f in fields(cls)]
    if not isinstance(value, Mapping):
        raise ConfigError(f"option {name!r} must be a dict with keys {', '.join(keys)}; got "
                          f"{value!r}")
    _reject_unknown(value, set(keys), name)
    return cls(**dict(value))


def did_you_mean(name: str, valid: Any) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _reject_unknown(options: Mapping[str, Any], valid: set[str], what: str) -> None:
    for key in options:
        if key not in valid:
            raise ConfigError(
                f"unknown {what} option {key!r}{did_you_mean(str(key), valid)}; "
                f"valid options: {', '.join(sorted(valid))}"
                + ("; graphopt.compile(model, options=...) also takes 'parallel', 'cluster' "
                   "(with parallel='auto') and 'mixed_precision' (with a plan)"
                   if what == "graphopt" else "")
            )


def _expect(value: Any, kind: type, name: str) -> Any:
    if not isinstance(value, kind):
        raise ConfigError(
            f"option {name!r} must be of type {kind.__name__}, got {type(value).__name__} "
            f"{value!r}"
        )
    return value


def _inductor_patches(value: Any) -> dict[str, Any]:
    patches = dict(_expect(value, Mapping, "inductor_config"))
    import torch._inductor.config as inductor_config

    defaults = inductor_config.get_config_copy()
    # get_config_copy leaves out the aliases of torch.compiler.config (force_disable_caches,
    # the static launcher's two): real options, refused as unknown before (a review)
    known = set(defaults) | set(getattr(inductor_config, "_config", {}))
    for key, value in patches.items():
        if key not in known:
            raise ConfigError(f"inductor_config key {key!r} is not a torch._inductor.config "
                              f"option{did_you_mean(str(key), known)}")
        if key == "custom_partitioner_fn":  # silently replaced before (a review)
            raise ConfigError("inductor_config 'custom_partitioner_fn' is graphopt's: its "
                              "joint passes and partition run there; drop it (lowering "
                              "'inductor' partitions with torch's min-cut after the passes)")
        default = defaults[key] if key in defaults else getattr(inductor_config, key, None)
        # the kind of the option's default: "False" (a string) for a bool turned the option
        # on, an int for a string list was ignored (a review); None (unset) is left to
        # Inductor, as are numpy numbers
        kinds = ((bool, (bool,), "a bool"), (int, (numbers.Integral,), "an int"),
                 (float, (numbers.Real,), "a number"), (str, (str,), "a str"))
        for kind, accepted, what in kinds:
            if value is not None and isinstance(default, kind):
                ok = isinstance(value, accepted) and (kind is bool or
                                                      not isinstance(value, bool))
                if not ok:
                    raise ConfigError(f"inductor_config {key!r} takes {what} (its default "
                                      f"is {default!r}), got {type(value).__name__} "
                                      f"{value!r}")
                break
    return patches


def _names(value: Any, option: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"option {option!r} must be a list of pass names, got {value!r}")
    return tuple(value)


def require_writable_file(path: Path, fix: str, what: str = "",
                          create_folder: bool = True, regular: bool = False) -> None:
    """Raise ConfigError ("cannot write <what><path> (<reason>): <fix>") unless a file can be
    written at ``path``, before any long work that would write it (an export, a
    calibration, a plan search). Checked by opening it for appending, since permission bits
    do not tell for root or /proc; a file this creates is removed again, an existing one is
    left as it is. ``create_folder``: create missing parent folders (else a missing folder
    is the reason). ``regular``: an existing path must be a regular file (a file that is read
    back: ``/dev/null`` took a whole ONNX export and then failed the checker with a raw
    traceback, a review)."""
    if path.is_dir():
        raise ConfigError(f"cannot write {what}{path} (it is a directory): {fix}")
    if regular and path.exists() and not path.is_file():
        raise ConfigError(f"cannot write {what}{path} (it is not a regular file: a device, "
                          f"pipe or socket, which cannot be read back): {fix}")
    existed = path.exists()
    try:
        if create_folder:
            path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write {what}{path} ({exc.strerror or exc}): {fix}") from exc
    if not existed:
        path.unlink(missing_ok=True)


def _writable_dir(value: Any, from_env: bool = False) -> Path:
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise ConfigError((f"environment variable {DUMP_DIR_ENV}" if from_env else
                           "option 'dump_dir'") + f" must be a non-empty path, got {value!r}"
                          + (f"; unset {DUMP_DIR_ENV} or set it to a directory"
                             if from_env else ""))
    where = (f"set {DUMP_DIR_ENV} to a writable directory or unset it" if from_env
             else "pass a writable directory")
    try:  # absolute: graphs compiled after a chdir went to another folder (a review)
        path = Path(value).expanduser().absolute()
    except RuntimeError as exc:  # "~nosuchuser/...": a raw traceback before (a review)
        raise ConfigError(f"dump_dir {str(value)!r}: {exc}; {where}") from None
    if path.exists() and not path.is_dir():
        raise ConfigError(f"dump_dir {str(path)!r} is a file, not a directory; {where}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".graphopt-write-test"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"dump_dir {str(path)!r} cannot be written ({exc.strerror or exc}); {where}"
        ) from exc
    return path


def npu_available() -> bool:
    return importlib.util.find_spec("torch_npu") is not None
