"""DecodeSpec: one definition of the default method for the API, the CLI and the bench; bench method
names parse into specs; bad options are refused by name."""

import inspect

import pytest

from medusa_decoding.config import CalibrationMode, CompileMode, MedusaError, NgramConfig, Numerics
from medusa_decoding.engine import MedusaModel
from medusa_decoding.models import shipped_drafter
from medusa_decoding.spec import COMPILED, EXACT, DecodeSpec, parse_method

from conftest import run_cli, save_tiny


def option_defaults(command) -> dict:
    """The defaults of a typer command's options, as the user gets them with no flags."""
    return {name: getattr(p.default, "default", p.default) for name, p in inspect.signature(command).parameters.items()}


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_cli_with_no_method_options_decodes_the_default_spec(command):
    from medusa_decoding import cli

    d = option_defaults(getattr(cli, command))
    spec = cli.decode_spec(d["heads"], d["tree"], d["no_medusa"], d["ngram"], d["tree_budget"], d["compile"], d["exact"],
                           d["calibration"], d["datastore"])
    assert spec == DecodeSpec()


def test_the_default_spec_is_the_shipped_drafter_with_the_ngram_branch_fitted_and_compiled():
    spec = DecodeSpec()
    assert spec.ngram == NgramConfig() and spec.compile is CompileMode.AUTO and spec.calibration is CalibrationMode.AUTO
    assert spec.exact is None and spec.fits_budget
    assert spec.drafter_folder("smollm2-135m-instruct") == shipped_drafter("smollm2-135m-instruct")
    assert DecodeSpec(tree="dynamic").drafter_folder("smollm2-135m-instruct") == shipped_drafter(
        "smollm2-135m-instruct", "medusa")
    assert DecodeSpec().drafter_folder("/some/folder") is None  # nothing shipped for it: the n-gram branch alone
    assert not DecodeSpec.plain().speculative and DecodeSpec.plain().drafter_folder("smollm2-135m-instruct") is None


def test_the_api_and_generate_decode_the_same_method(tmp_path_factory, capsys, monkeypatch):
    """from_pretrained(model, heads=...) and `medusa generate --model ... --heads ...` with no other
    method options: the same method string and the same tokens."""
    folder, heads = save_tiny(tmp_path_factory, max_positions=128)
    model = MedusaModel.from_pretrained(str(folder), heads=heads, compile="off", dtype="float32", device="cpu")
    out = model.generate("hello", chat=False, max_new_tokens=12)
    code, text, err = run_cli(capsys, monkeypatch, "generate", "-p", "hello", "--model", folder, "--heads", heads,
                              "--no-chat", "-n", "12", "--no-compile", "--dtype", "float32", "--device", "cpu")
    assert code == 0 and text == out.text + "\n"
    assert err.splitlines()[-1].startswith(f"[{model.method().describe()}] ")
    assert "n-gram branch" in model.method().describe() and model.spec == DecodeSpec(drafter=str(heads), compile="off")


def test_spec_options_are_checked_by_name():
    with pytest.raises(MedusaError, match="unknown decoding option 'heds'"):
        DecodeSpec().with_options(heds="x")
    with pytest.raises(MedusaError, match="tree_budget must be >= 2"):
        DecodeSpec(tree_budget=1)
    with pytest.raises(MedusaError, match="a datastore feeds the n-gram branch"):
        DecodeSpec(ngram=0, datastore="store.safetensors")
    with pytest.raises(MedusaError, match="exact mode runs eager"):
        DecodeSpec(exact=True, compile="on")
    with pytest.raises(MedusaError, match="unknown compile mode"):
        DecodeSpec(compile="sometimes")
    with pytest.raises(MedusaError, match="unknown drafter 'owl'"):
        DecodeSpec(drafter="shipped:owl")
    assert DecodeSpec(ngram=3).ngram == NgramConfig(length=3) and DecodeSpec(ngram=False).ngram is None


@pytest.mark.parametrize("name, drafter, ngram, tree, calibration, exact, compile", [
    ("plain", None, False, None, CalibrationMode.SHIPPED, False, CompileMode.OFF),
    ("plain+ngram", None, True, None, CalibrationMode.SHIPPED, False, CompileMode.OFF),
    ("default", "shipped", True, None, CalibrationMode.AUTO, False, CompileMode.OFF),
    ("default@shipped", "shipped", True, None, CalibrationMode.SHIPPED, False, CompileMode.OFF),
    ("medusa", "shipped:medusa", False, None, CalibrationMode.SHIPPED, False, CompileMode.OFF),
    ("dynamic+ngram", "shipped:medusa", True, "dynamic", CalibrationMode.SHIPPED, False, CompileMode.OFF),
    ("hydra+ngram@compiled", "shipped:hydra", True, None, CalibrationMode.AUTO, False, CompileMode.OFF),
    ("eagle@exact", "/ckpt/eagle", False, None, CalibrationMode.AUTO, True, CompileMode.OFF),
])
def test_bench_method_names_parse_into_specs(name, drafter, ngram, tree, calibration, exact, compile):
    shared = DecodeSpec(compile="off", exact=False)
    spec = parse_method(name).spec(shared, {"eagle": "/ckpt/eagle"})
    assert (spec.drafter, spec.ngram is not None, spec.tree) == (drafter, ngram, tree)
    assert (spec.calibration, spec.exact, spec.compile) == (calibration, exact, compile)


def test_bench_method_names_keep_their_parts():
    m = parse_method("hydra+ngram@compiled")
    assert (m.kind, m.ngram, m.shipped, m.mode, m.core, m.engine) == ("hydra", True, False, COMPILED, "hydra+ngram", True)
    assert parse_method("default@shipped@exact").mode == EXACT and parse_method("default@shipped@exact").shipped
    assert not parse_method("llama.cpp").engine
    with pytest.raises(MedusaError, match="not our engine's"):
        parse_method("hf").spec()
    m = parse_method("default@shipped@int8@compiled")
    assert (m.kind, m.shipped, m.numerics, m.mode, m.core) == ("default", True, Numerics.INT8, COMPILED,
                                                                "default@shipped@int8")
    assert m.spec().numerics is Numerics.INT8 and parse_method("default").spec().numerics is Numerics.FP32


@pytest.mark.parametrize("name, message", [
    ("owl", "unknown method 'owl'"),
    ("default+ngram", "unknown method"),
    ("hf+ngram", "unknown method"),
    ("plain+owl", "unknown method"),
    ("medusa@shipped", "@shipped is for default, hydra, eagle"),
    ("hf-pld@exact", "@exact is for our engine's methods"),
    ("llama.cpp@int8", "@int8 is for our engine's methods"),
    ("plain@int8@stock", "@int8 runs the linears on a GGUF's blocks"),
    ("plain@compiled@int8", "unknown method"),
])
def test_bad_bench_method_names_are_refused(name, message):
    with pytest.raises(MedusaError, match=message):
        parse_method(name)
