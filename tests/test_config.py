"""Option validation: every bad option is a clear error raised before any compile work."""

import re
import sys

import pytest
import torch

import graphopt
from graphopt import ConfigError, GraphoptConfig, LoweringUnavailableError
from graphopt.config import npu_available


def _compile_and_call(options):
    fn = torch.compile(lambda x: x.sin() + 1, backend="graphopt", options=options)
    return fn(torch.randn(4))


@pytest.mark.parametrize("options, message", [
    ({"lowerin": "eager"}, r"unknown graphopt option 'lowerin' \(did you mean 'lowering'\?\)"),
    ({"lowering": "tpu"}, r"unknown lowering 'tpu'; valid lowerings: auto, eager, inductor, npu"),
    ({"lowering": 3}, r"option 'lowering' must be of type str, got int"),
    ({"verify": "yes"}, r"option 'verify' must be a bool or a dict"),
    ({"verify": {"rtl": 1e-3}}, r"unknown verify option 'rtl' \(did you mean 'rtol'\?\)"),
    ({"verify": {"rtol": -1}}, r"verify.rtol must be a finite non-negative number"),
    ({"verify": {"enabled": False, "rtol": 1}}, r"rtol would do nothing"),
    ({"disable": ["cs"]}, r"option 'disable' names unknown pass 'cs' \(did you mean 'cse'\?\)"),
    ({"disable": "cse,remove_noops"}, r"unknown pass 'cse,remove_noops'"),
    ({"enable": ["cse"]}, r"pass 'cse' already runs by default"),
    ({"enable": ["cse"], "disable": ["cse"]}, r"named in both 'enable' and 'disable'"),
    ({"enable": ["remat"], "disable": ["remat"], "remat": {"budget": 0}},
     r"named in both 'enable' and 'disable'"),
    ({"inductor_config": ["x"]}, r"option 'inductor_config' must be of type Mapping"),
    # an option that would do nothing is an error
    ({"enable": ["remat"]}, r"enable: \['remat'\] means options=\{'remat': \{\}\}, which is "
                            r"incomplete: remat needs a budget"),
    ({"inductor_config": {"max_autotune": True}, "lowering": "eager"},
     r"option 'inductor_config' patches Inductor, but lowering is 'eager'"),
    ({"remat": {}}, r"remat needs a budget, e.g. options=\{'remat': \{'budget': '50%'\}\}"),
    # 0 == False in Python: "remat": 0 switched remat off silently (a review); only None and
    # False do
    ({"remat": 0}, r"option 'remat' must be a dict with keys budget.*got 0\b"),
    ({"moe": 0.0}, r"option 'moe' must be a dict with keys ep.*got 0.0\b"),
])
def test_bad_option_raises_before_compiling(options, message):
    with pytest.raises(ConfigError, match=message):
        GraphoptConfig.from_options(options)
    with pytest.raises(Exception, match=message):
        _compile_and_call(options)
    assert graphopt.reports() == []  # the pipeline never started


def test_unwritable_dump_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="dump_dir .* cannot be written.*pass a writable"):
        GraphoptConfig.from_options({"dump_dir": str(blocker / "sub")})
    monkeypatch.setenv("GRAPHOPT_DUMP_DIR", str(blocker / "sub"))
    with pytest.raises(ConfigError, match="set GRAPHOPT_DUMP_DIR to a writable directory"):
        GraphoptConfig.from_options({})
    with pytest.raises(ConfigError, match="option 'dump_dir' must be a non-empty path"):
        GraphoptConfig.from_options({"dump_dir": 5})
    monkeypatch.setenv("GRAPHOPT_DUMP_DIR", " ")  # named as the variable (a review)
    with pytest.raises(ConfigError, match="environment variable GRAPHOPT_DUMP_DIR must be"):
        GraphoptConfig.from_options({})


def test_dump_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_DUMP_DIR", str(tmp_path / "env"))
    assert GraphoptConfig.from_options({}).dump_dir == tmp_path / "env"
    assert GraphoptConfig.from_options({"dump_dir": str(tmp_path)}).dump_dir == tmp_path


@pytest.mark.skipif(npu_available(), reason="torch_npu is installed here")
def test_npu_without_torch_npu_says_what_to_install():
    with pytest.raises(LoweringUnavailableError, match=r"pip install 'graphopt\[npu\]'"):
        GraphoptConfig.from_options({"lowering": "npu"})


@pytest.mark.skipif(npu_available(), reason="torch_npu is installed here")
def test_npu_installed_but_not_importable_says_why(tmp_path, monkeypatch):
    """A torch_npu that fails at import (CANN's environment not sourced) passed the check,
    which only looked for the package, and failed at the first call inside Dynamo's error
    (a review). Here a stand-in package raises the ImportError torch_npu raises then."""
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(LoweringUnavailableError, match=r"torch_npu is installed but does not "
                       r"import \(ImportError: libhccl.so.*set_env.sh"):
        GraphoptConfig.from_options({"lowering": "npu"})


@pytest.mark.skipif(npu_available(), reason="torch_npu is installed here")
def test_npu_without_torchair_says_what_to_install(tmp_path, monkeypatch):
    """A torch_npu that imports without the torchair it should ship passed validation and
    failed at the first call with a bare ModuleNotFoundError (a review)."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)  # the stand-in imports:
    try:  # it must not stay imported for later tests
        with pytest.raises(LoweringUnavailableError, match=r"its graph compiler torchair "
                           r"does not \(ModuleNotFoundError.*bundles torchair"):
            GraphoptConfig.from_options({"lowering": "npu"})
    finally:
        sys.modules.pop("torch_npu", None)


def test_unknown_mode():
    with pytest.raises(ConfigError, match="unknown torch.compile mode 'fastest'"):
        GraphoptConfig.from_options({}, mode="fastest")


def test_config_is_frozen_and_typed():
    config = GraphoptConfig.from_options({"verify": {"rtol": 1e-3}, "disable": "cse"})
    assert config.verify.enabled and config.verify.rtol == 1e-3
    assert config.disable == ("cse",)
    with pytest.raises(AttributeError):
        config.lowering = "eager"  # type: ignore[misc]


@pytest.mark.parametrize("options, message", [
    ({"verify": {"grads": "no"}}, r"verify.grads must be True or False"),
    ({"verify": {"rtol": float("nan")}}, r"verify.rtol must be a finite non-negative number"),
    ({"verify": {"rtol": True}}, r"verify.rtol must be a finite non-negative number"),
    ({"dump_dir": ""}, r"option 'dump_dir' must be a non-empty path"),
    ({"inductor_config": {"no_such_knob": 1}}, r"inductor_config key 'no_such_knob' is not"),
    # values of the default's type (a review: "False" turned size_asserts on; a partitioner
    # of the user's was replaced silently)
    ({"inductor_config": {"size_asserts": "False"}},
     r"inductor_config 'size_asserts' takes a bool \(its default is True\), got str"),
    ({"inductor_config": {"max_autotune_gemm_backends": 5}},
     r"inductor_config 'max_autotune_gemm_backends' takes a str"),
    ({"inductor_config": {"compile_threads": "2"}},
     r"inductor_config 'compile_threads' takes an int"),
    ({"inductor_config": {"custom_partitioner_fn": print}},
     r"inductor_config 'custom_partitioner_fn' is graphopt's"),
    ({"mode": 5}, r"option 'mode' must be of type str"),
    # accepted and ignored, or contradictory (a review)
    ({"remat": {"budget": "50%", "solver": "greedy", "time_limit": 2}},
     r"remat.time_limit bounds the ILP solver; solver 'greedy' does not use it"),
    ({"moe": {"profile": "b200"}}, r"with moe.ep=1 there is no exchange"),
    ({"moe": {"ranks_per_node": 1}}, r"with moe.ep=1 there is no exchange"),
    # a docs review: "ranks_per_node (8) must divide moe.ep (1)" pointed to the wrong fix
    ({"moe": {"ep": 1, "ranks_per_node": 8}}, r"with moe.ep=1 there is no exchange"),
    ({"moe": False, "enable": ["moe"]}, r"switches the moe pass off and enable: \['moe'\] on"),
])
def test_bad_nested_values(options, message):
    with pytest.raises(ConfigError, match=message):
        GraphoptConfig.from_options(options)


def test_graphopt_compile_validates_immediately():
    with pytest.raises(ConfigError, match="unknown graphopt option 'lowring'"):
        graphopt.compile(torch.nn.Linear(2, 2), options={"lowring": "eager"})
    model = graphopt.compile(torch.nn.Linear(2, 2), options={"lowering": "eager"})
    model(torch.randn(3, 2))
    assert graphopt.last_report().status == "compiled"


def test_graphopt_compile_takes_a_mode_and_names_bad_options():
    """graphopt.compile(model, mode=...) always failed (torch.compile refuses mode= with
    options=, and it passed both); non-dict options failed with a bare ValueError (a
    review). The mode goes into the options; bad options are ConfigErrors."""
    # (compiled lazily: the mode is checked here, Inductor would compile on the call)
    graphopt.compile(torch.nn.Linear(2, 2), mode="max-autotune-no-cudagraphs",
                     options={"mode": None, "verify": False})
    with pytest.raises(ConfigError, match="configures Inductor, but lowering is 'eager'"):
        graphopt.compile(torch.nn.Linear(2, 2), mode="max-autotune-no-cudagraphs",
                         options={"lowering": "eager"})
    for bad, message in (("exact", "graphopt options must be a dict"),
                         (5, "graphopt options must be a dict"),
                         (GraphoptConfig(), "takes the options dict"),
                         ({"mode": "default"}, "mode is given twice")):
        with pytest.raises(ConfigError, match=message):
            graphopt.compile(torch.nn.Linear(2, 2), options=bad, mode="max-autotune")
    with pytest.raises(ConfigError, match="unknown torch.compile mode 'fastest'"):
        graphopt.compile(torch.nn.Linear(2, 2), mode="fastest")


def test_options_given_as_a_list_name_the_expected_form():
    with pytest.raises(ConfigError, match=r"graphopt options must be a dict such as"):
        GraphoptConfig.from_options(["attention", "exact"])


@pytest.mark.parametrize("budget, hint", [
    (1, "write 1.0 or '100%'"), (50, "write '50%' (= 0.5)"), (500, "a float in [0, 1]")])
def test_remat_budget_hints_suggest_values_that_are_accepted(budget, hint):
    with pytest.raises(ConfigError, match=re.escape(hint)):
        GraphoptConfig.from_options({"remat": {"budget": budget}})
    suggested = {1: 1.0, 50: "50%", 500: 0.5}[budget]
    assert GraphoptConfig.from_options({"remat": {"budget": suggested}}).remat is not None


def test_enable_and_pass_options_mean_the_same():
    """Pass options are parsed by the pass that owns them (through the registry)."""
    from graphopt.passes import build_pipeline, get_pass, option_keys

    assert option_keys()["moe"] == "moe" and option_keys()["remat"] == "remat"
    by_enable = GraphoptConfig.from_options({"enable": ["moe"]})
    by_options = GraphoptConfig.from_options({"moe": {}})
    assert by_enable.moe == by_options.moe == get_pass("moe").options_cls()
    remat = GraphoptConfig.from_options({"remat": {"budget": 0.5}})
    assert [p.name for p in build_pipeline(remat, "joint")] == ["remat"]
    assert GraphoptConfig.from_options({}).moe is None


def test_readme_use_block_is_valid_verbatim(monkeypatch):
    """The README's options example, executed as written, passes validation."""
    import pathlib

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    block = readme.split("```python\n", 1)[1].split("```", 1)[0]
    seen = {}

    def fake_compile(model, backend, options):
        seen["options"] = options
        return GraphoptConfig.from_options(options)

    namespace = {"model": torch.nn.Linear(2, 2)}
    monkeypatch.setattr(torch, "compile", fake_compile)
    exec(block, namespace)
    assert namespace["model"].remat is not None and seen["options"]["attention"] == "exact"


def test_inductor_config_accepts_none_and_numpy_numbers():
    """None (unset) and numpy numbers are Inductor's to take (a re-review found options
    typed ``int | None`` refused)."""
    import numpy as np

    config = GraphoptConfig.from_options({"inductor_config": {
        "compile_threads": None, "cpp.threads": np.int32(2), "cpp.min_chunk_size": np.int64(8)}})
    assert config.inductor_config["compile_threads"] is None



def test_inductor_config_takes_torch_compiler_aliases(tmp_path, monkeypatch):
    """torch._inductor.config's aliases of torch.compiler.config (force_disable_caches, the
    static launcher's) are options: refused as unknown before (a review); their type is
    checked, and turning the caches on while dumping is a conflict."""
    config = GraphoptConfig.from_options({"inductor_config": {
        "force_disable_caches": True, "use_static_triton_launcher": False}})
    assert config.inductor_config["force_disable_caches"] is True
    with pytest.raises(ConfigError, match=r"'force_disable_caches' takes a bool"):
        GraphoptConfig.from_options({"inductor_config": {"force_disable_caches": "yes"}})
    monkeypatch.setenv("GRAPHOPT_DUMP_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=r"dump directory \(GRAPHOPT_DUMP_DIR"):
        GraphoptConfig.from_options({"inductor_config": {"force_disable_caches": False}})
    monkeypatch.delenv("GRAPHOPT_DUMP_DIR")
    with pytest.raises(ConfigError, match=r"force_disable_caches=False with a dump "
                       r"directory \(option 'dump_dir'\)"):
        GraphoptConfig.from_options({"inductor_config": {"force_disable_caches": False},
                                     "dump_dir": str(tmp_path)})


@pytest.mark.skipif(npu_available(), reason="torch_npu is installed here")
def test_npu_with_an_older_torchair_says_what_to_install(tmp_path, monkeypatch):
    """A torchair without the CompilerConfig / get_compiler the NPU lowering calls passed
    validation and failed at the first call with "No module named 'torchair.configs'"
    (a review)."""
    for name in ("torch_npu", "torchair"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(LoweringUnavailableError, match=r"its graph compiler torchair "
                           r"does not \(ModuleNotFoundError.*torchair.configs.*bundles"):
            GraphoptConfig.from_options({"lowering": "npu"})
    finally:
        for name in ("torch_npu", "torchair"):
            sys.modules.pop(name, None)


def test_the_contradiction_checks_refuse_only_contradictions():
    """A re-review of the checks above: 'lightning': None (a section of the attention pass,
    not its switch) was refused next to enable: ['attention']; a parsed greedy RematOptions
    could not be copied (its time_limit default was written into the field); an
    MoEOptions object for a parallel plan (whose ep replaces 1) could not carry
    ranks_per_node or profile."""
    import dataclasses

    from graphopt.passes.moe_options import MoEOptions
    from graphopt.passes.remat_options import RematOptions

    with pytest.raises(ConfigError, match="'attention' already runs by default"):
        GraphoptConfig.from_options({"attention": "lightning", "lightning": None,
                                     "enable": ["attention"]})  # (not "switches it off")
    greedy = RematOptions.parse({"budget": "50%", "solver": "greedy"})
    assert dataclasses.replace(greedy, budget="25%").time_limit is None
    assert RematOptions.parse(dataclasses.asdict(greedy)) == greedy
    assert MoEOptions(ranks_per_node=1, profile="h200").profile == "h200"


def test_generate_on_graphopt_compile_s_result_warns_and_in_place_compiles():
    """torch.compile's module wrapper hands generate to the original module, so
    graphopt.compile(model).generate ran the decoding uncompiled, with no word (a review:
    no graph compiled, no kernel call). It warns now, naming the in-place compile, which
    compiles what generate calls; the tokens equal eager's either way."""
    import copy

    from graphopt.models import build_model

    torch.manual_seed(0)
    model = build_model("llama", dtype=torch.float64)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 256, (1, 7))
    want = ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    compiled = graphopt.compile(model, options={"lowering": "eager"})
    graphopt.clear_reports()
    with pytest.warns(UserWarning, match="runs the model uncompiled .* model.compile"):
        out = compiled.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, want) and not graphopt.reports()
    assert "generate" not in vars(model)  # set on the wrapper, not the caller's model
    model.compile(backend="graphopt", options={"lowering": "eager"})
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, want) and graphopt.reports()


def test_inductor_s_sympy_exponent_error_names_the_fixes(monkeypatch):
    """MiniMax's block loop after a dynamic recompile failed in Inductor with torch's
    "Exponent must be non-negative" and no hint (backend='inductor' fails the same; a
    review): graphopt names attention='exact', the eager lowering and dynamic=False."""
    import graphopt.lowering.inductor as inductor
    from graphopt.errors import LoweringUnavailableError

    def failing(*args, **kwargs):
        raise ValueError("Exponent must be non-negative.")

    monkeypatch.setattr(inductor, "compile_fx_inner", failing)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x.sin() * 2, backend="graphopt",
                             options={"lowering": "inductor"})
    with pytest.raises(Exception) as info:
        compiled(torch.randn(4))
    chain, exc = [], info.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or getattr(exc, "inner_exception", None)
    found = [e for e in chain if isinstance(e, LoweringUnavailableError)]
    assert found and "options={'attention': 'exact'}" in str(found[0]), chain
    assert "torch.compile(..., dynamic=False)" in str(found[0])
    torch._dynamo.reset()
