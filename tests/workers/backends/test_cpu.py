"""The cpu backends through the real compile child, with real torch, and the model-loading helpers."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._inductor.exc import CppCompileError, InductorError

from compilesvc.demo import demo_spec
from compilesvc.hostinfo import host_isa
from compilesvc.spec.parsing import parse_spec
from compilesvc.states import ErrorClass
from tests.workers import DEMO_MODEL, ChildRun, run_child, run_children, text_inputs
from workers.backends.cpu import _inductor_failure, trace_bucket
from workers.backends.cpu_warnings import (
    GUARDS_TRACER_WARNING,
    TRACER_WARNING_EXPLAINED,
    kept_tracer_warnings,
    silenced,
)
from workers.compiling.classify import classify
from workers.compiling.contract import CompileFailure, InfraError, InputDesc
from workers.compiling.model_loading import example_inputs, load_model, order_inputs, safe_extract

ATOL = 1e-4
RTOL = 1e-3


class TinyEncoder(nn.Module):
    """A small transformer-ish model: embedding, one encoder layer, a linear head over tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.layer(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        return self.head(x)


class FixedSeq(nn.Module):
    """Runs only at sequence length 8: the reshape fails at any other (the model's own error)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids).reshape(input_ids.shape[0], 8 * 4)


class FirstTokens(nn.Module):
    """Sums the embeddings of the first n tokens, n read from the mask's values: export keeps the read
    (aten.item), a trace freezes the n of its example inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        n = attention_mask[0].sum().item()
        torch._check(n >= 0)
        torch._check(n <= input_ids.shape[1])
        return self.embed(input_ids[:, :n]).sum(1)


class Branchy(nn.Module):
    """Data-dependent control flow in Python: the branch taken depends on the mask's values."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if attention_mask.sum() > 3:
            return input_ids * 2
        return input_ids


def _warnings(lines: list[str]) -> list[str]:
    """Lines Python's warnings module printed ("path:line: SomeWarning: message")."""
    return [line for line in lines if re.search(r":\d+: \w*Warning: ", line)]


def _inputs(batch: int, seq: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[0, seq // 2:] = 0  # padding in one row: the mask must reach the model
    return torch.randint(0, 100, (batch, seq), generator=generator), mask


def _demo_eager() -> nn.Module:
    return torch.export.load(str(DEMO_MODEL)).module()


def _assert_ok(run: ChildRun) -> None:
    assert run.returncode == 0, run.describe()
    assert run.result and run.result["status"] == "ok", run.describe()


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    tiny = TinyEncoder().eval()
    ids, mask = _inputs(1, 8)
    with torch.no_grad():
        torch.jit.save(torch.jit.trace(tiny, (ids, mask)), str(root / "tiny.pt"))
        torch.jit.save(torch.jit.trace(FixedSeq().eval(), (ids, mask)), str(root / "fixed-seq.pt"))
    torch.save(tiny.state_dict(), root / "tiny.state")
    static = torch.export.export(torch.export.load(str(DEMO_MODEL)).module(), _inputs(2, 16))
    torch.export.save(static, str(root / "static.pt2"))  # exported at (2, 16) only
    torch.export.save(torch.export.export(FirstTokens().eval(), _inputs(2, 8)), str(root / "first-tokens.pt2"))
    return {"tiny": root / "tiny.pt", "fixed-seq": root / "fixed-seq.pt", "tiny-state": root / "tiny.state",
            "static": root / "static.pt2", "first-tokens": root / "first-tokens.pt2"}


def test_torchscript_is_byte_identical_and_matches_eager(tmp_path: Path) -> None:
    fields = {"inputs": text_inputs(2, 16), "args": ["--freeze"]}
    first, second = run_children(tmp_path, [("a", fields), ("b", fields)])
    _assert_ok(first)
    _assert_ok(second)
    assert (first.out_dir / "model.pt").read_bytes() == (second.out_dir / "model.pt").read_bytes()
    assert first.result["files"][0]["sha256"] == second.result["files"][0]["sha256"]
    assert first.result["files"][0] | {"bytes": 0} == {"path": "model.pt", "role": "model", "bytes": 0,
                                                       "sha256": first.result["files"][0]["sha256"]}
    versions = first.result["versions"]
    assert versions["torch"] == torch.__version__ and versions["isa"] == host_isa() and versions["python"]
    assert first.result["compile_seconds"] > 0
    assert any("[compile-child] traced in" in line for line in first.lines)

    loaded = torch.jit.load(str(first.out_dir / "model.pt"))
    eager = _demo_eager()
    for seed in (1, 2):  # values other than the example inputs: the graph, not a constant, was captured
        ids, mask = _inputs(2, 16, seed)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids, mask), eager(ids, mask), atol=ATOL, rtol=RTOL)


def test_torchscript_model_file_with_optimize_for_inference(tmp_path: Path, model_files: dict[str, Path]) -> None:
    run = run_child(tmp_path, "ofi", model_path=str(model_files["tiny"]), model_format="torchscript",
                    inputs=list(reversed(text_inputs(1, 8))),  # spec order differs from forward's
                    args=["--optimize-for-inference"])
    _assert_ok(run)
    assert "inputs input_ids:int64[1, 8], attention_mask:int64[1, 8]" in run.stdout  # forward's order
    # Tracing a ScriptModule is a no-op: said once in our words, not torch's UserWarning.
    assert _warnings(run.lines) == [] and "no-op" not in run.stderr
    assert "[compile-child] the model is TorchScript already: used as loaded" in run.stdout
    eager = TinyEncoder().eval()
    eager.load_state_dict(torch.load(model_files["tiny-state"]))
    loaded = torch.jit.load(str(run.out_dir / "model.pt"))
    ids, mask = _inputs(1, 8, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, mask), eager(ids, mask), atol=ATOL, rtol=RTOL)


def test_demo_spec_compiles_at_its_three_buckets(tmp_path: Path) -> None:
    spec = parse_spec(demo_spec())
    assert (spec.target, spec.sdk, spec.backend, spec.model.format) == ("cpu", "2.13.0", "torchscript",
                                                                        "exported-program")
    assert DEMO_MODEL.stat().st_size < 400_000
    runs = []
    for index, bucket in enumerate(spec.buckets):
        inputs = [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in bucket.inputs]
        runs.append((f"bucket{index}", {"inputs": inputs, "args": list(spec.compiler.args)}))
    eager = _demo_eager()
    for (_, fields), run in zip(runs, run_children(tmp_path, runs), strict=True):
        _assert_ok(run)
        batch, seq = fields["inputs"][0]["shape"]
        ids, mask = _inputs(batch, seq)
        with torch.no_grad():
            got = torch.jit.load(str(run.out_dir / "model.pt"))(ids, mask)
            torch.testing.assert_close(got, eager(ids, mask), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("backend", "model", "fmt", "code"), [
    ("torchscript", "fixed-seq", "torchscript", "CPU_TRACE_ERROR"),
    ("aotinductor", "static", "exported-program", "CPU_EXPORT_ERROR"),
])
def test_model_failing_at_the_bucket_shape_is_a_compile_error(tmp_path: Path, model_files: dict[str, Path],
                                                               backend: str, fmt: str, model: str,
                                                               code: str) -> None:
    run = run_child(tmp_path, "fails", backend=backend, model_path=str(model_files[model]), model_format=fmt,
                    inputs=text_inputs(2, 12))
    assert run.returncode == 3, run.describe()
    assert run.result is not None and run.result["status"] == "compile_error"
    assert run.result["code"] == code
    assert "\n" not in run.result["message"] and "forward fails at these input shapes" in run.result["message"]
    assert not (run.out_dir / "model.pt").exists() and not (run.out_dir / "model.pt2").exists()
    outcome = classify(run.returncode, run.result, run.lines[-50:], timed_out=False, cancelled=False)
    assert (outcome.error_class, outcome.code, outcome.retryable) == ("compile", code, False)


@pytest.mark.slow
def test_aotinductor_compiles_and_matches_eager(tmp_path: Path) -> None:
    run = run_child(tmp_path, "aoti", backend="aotinductor", inputs=text_inputs(2, 16), isa=host_isa(),
                    args=["--freezing"])
    _assert_ok(run)
    assert run.result["files"][0]["path"] == "model.pt2"
    assert run.result["versions"]["isa"] == host_isa()
    cache = tmp_path / "runs" / "compilesvc-inductor-cache"
    assert any(cache.iterdir()), "inductor must have used the fixed cache next to the work dir"
    assert f"inductor cache {cache}" in run.stdout
    assert _warnings(run.lines) == [], run.stderr  # torch's LeafSpec FutureWarning is silenced, and said so
    assert "[compile-child] silenced torch's FutureWarning '`isinstance(treespec, LeafSpec)` is deprecated'" \
        in run.stdout

    package = torch._inductor.aoti_load_package(str(run.out_dir / "model.pt2"))
    ids, mask = _inputs(2, 16, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(package(ids, mask), _demo_eager()(ids, mask), atol=ATOL, rtol=RTOL)


def test_aotinductor_refuses_a_host_with_another_isa(tmp_path: Path) -> None:
    other = "x86_64-avx2" if host_isa() != "x86_64-avx2" else "x86_64-avx512"
    run = run_child(tmp_path, "isa", backend="aotinductor", isa=other)
    assert run.returncode == 4, run.describe()
    assert run.result == {"status": "infra_error", "code": "WRONG_HOST", "message": run.result["message"]}
    outcome = classify(run.returncode, run.result, run.lines, timed_out=False, cancelled=False)
    assert (outcome.error_class, outcome.code, outcome.retryable) == ("infra", "WRONG_HOST", True)


def test_bad_request_exits_2_without_result(tmp_path: Path) -> None:
    run = run_child(tmp_path, "bad", backend="aotinductor", model_format="torchscript")
    assert run.returncode == 2 and run.result is None
    assert "model_format" in run.stderr


def test_uncaught_exception_exits_nonzero_with_traceback_and_no_result(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where out_dir should be")
    run = run_child(tmp_path, "crash", out_dir=str(blocker))
    assert run.returncode == 1, run.describe()
    assert run.result is None
    assert "Traceback (most recent call last)" in run.stderr
    outcome = classify(run.returncode, run.result, run.lines, timed_out=False, cancelled=False)
    assert (outcome.error_class, outcome.code) == ("infra", "HOST_OS_ERROR")  # the traceback's OSError


def test_missing_model_file_is_infrastructure(tmp_path: Path) -> None:
    run = run_child(tmp_path, "missing", model_path=str(tmp_path / "nope.pt2"))
    assert run.returncode == 4, run.describe()
    assert run.result is not None and run.result["code"] == "MODEL_FILE_MISSING"


# In-process checks of the model-loading helpers (real torch, real files).

def test_example_inputs_are_deterministic_and_valid() -> None:
    descs = [InputDesc("input_ids", (2, 5), "int64"), InputDesc("attention_mask", (2, 5), "int64"),
             InputDesc("pixel_values", (2, 3), "bfloat16"), InputDesc("flags", (4,), "bool"),
             InputDesc("token_type_ids", (2, 5), "int32")]
    first, second = example_inputs(descs), example_inputs(descs)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    ids, mask, pixels, flags, types = first
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < 100
    assert torch.equal(mask, torch.ones(2, 5, dtype=torch.int64))
    assert pixels.dtype == torch.bfloat16 and float(pixels.float().std()) > 0.1
    assert flags.dtype == torch.bool and not bool(flags.any())
    assert types.dtype == torch.int32 and int(types.max()) < 100
    # Values depend on the name, not on the position.
    assert torch.equal(example_inputs(list(reversed(descs)))[-1], ids)


def test_order_inputs_follows_forward(model_files: dict[str, Path], tmp_path: Path) -> None:
    descs = [InputDesc("attention_mask", (1, 4), "int64"), InputDesc("input_ids", (1, 4), "int64")]
    for path, fmt in ((model_files["tiny"], "torchscript"), (DEMO_MODEL, "exported-program")):
        model = load_model(path, fmt, tmp_path, [d.name for d in descs])
        assert [d.name for d in order_inputs(model, descs)] == ["input_ids", "attention_mask"]


def _tar(path: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return path


@pytest.mark.parametrize(("members", "links"), [
    ({"../evil.txt": b"x", "config.json": b"{}"}, None),
    ({"/abs/evil.txt": b"x", "config.json": b"{}"}, None),
    ({"config.json": b"{}"}, {"escape": "../../../etc/passwd"}),
])
def test_hf_dir_archives_cannot_escape_the_work_dir(tmp_path: Path, members: dict[str, bytes],
                                                    links: dict[str, str] | None) -> None:
    archive = _tar(tmp_path / "model.tar.gz", members, links)
    with pytest.raises(CompileFailure) as failure:
        safe_extract(archive, tmp_path / "work" / "hf-model")
    assert failure.value.code == "HF_DIR_UNSAFE_ARCHIVE"
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "work" / "evil.txt").exists()


def test_hf_dir_root_is_found_and_transformers_is_required(tmp_path: Path) -> None:
    archive = _tar(tmp_path / "model.tar", {"bert-tiny/config.json": b"{}", "bert-tiny/model.safetensors": b""})
    root = safe_extract(archive, tmp_path / "extract")
    assert root == tmp_path / "extract" / "bert-tiny"
    with pytest.raises(CompileFailure) as failure:
        safe_extract(_tar(tmp_path / "empty.tar", {"weights.bin": b""}), tmp_path / "extract2")
    assert failure.value.code == "HF_DIR_NO_CONFIG"

    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(InfraError) as missing:
            load_model(archive, "hf-dir", tmp_path / "work", ["input_ids", "attention_mask"])
        assert missing.value.code == "TRANSFORMERS_MISSING"
        assert "transformers is not installed on this worker" in missing.value.message
    else:
        pytest.skip("transformers is installed here; the missing-package path cannot be shown")


def test_an_hf_dir_without_weights_is_a_final_compile_error_on_the_first_attempt(tmp_path: Path) -> None:
    # Seen: transformers' "no file named model.safetensors" OSError was read as the host's file trouble,
    # retried three times and reported as an outage (exit 3). It is the archive's fault on every worker.
    archive = _tar(tmp_path / "noweights.tar.gz", {"tiny/config.json": b'{"model_type": "bert"}',
                                                  "tiny/tokenizer.json": b"{}"})
    run = run_child(tmp_path, "noweights", model_path=str(archive), model_format="hf-dir",
                    inputs=text_inputs(1, 8))
    assert run.result is not None and run.result["status"] == "compile_error", run.describe()
    assert run.result["code"] == "HF_DIR_NO_WEIGHTS" and "model.safetensors" in run.result["message"]
    outcome = classify(run.returncode, run.result, run.lines[-50:], timed_out=False, cancelled=False)
    assert outcome.error_class == ErrorClass.COMPILE


def test_a_cpp_compile_error_is_reported_by_its_output_not_its_command(capsys: pytest.CaptureFixture[str]) -> None:
    # torch's own exceptions, as aoti_compile_and_package raises them: InductorError around CppCompileError.
    command = ["g++", *(f"-I/venv/include/torch/csrc/inductor/dir{i}" for i in range(120)), "-o", "model.so"]
    output = "/tmp/cache/ab/cab.cpp:12:5: error: 'foo' was not declared in this scope"
    try:
        raise CppCompileError(command, output)
    except CppCompileError as inner:
        wrapped = InductorError(inner, None)
    message = CompileFailure("CPU_INDUCTOR_ERROR", _inductor_failure(wrapped)).message
    assert message == f"AOTInductor failed: the C++ compiler failed: {output}"
    assert "the C++ compiler failed; its command: g++ -I/venv/include" in capsys.readouterr().out  # in the log
    assert _inductor_failure(RuntimeError("boom")) == "AOTInductor failed: RuntimeError: boom"


def test_the_demo_log_has_no_unexplained_framework_warning(tmp_path: Path) -> None:
    spec = parse_spec(demo_spec())
    bucket = spec.buckets[0]
    run = run_child(tmp_path, "demo", inputs=[{"name": i.name, "shape": list(i.shape), "dtype": i.dtype}
                                              for i in bucket.inputs], args=list(spec.compiler.args))
    _assert_ok(run)
    assert _warnings(run.lines) == [] and run.stderr == "", run.stderr
    silenced_lines = [line for line in run.lines if line.startswith("[compile-child] silenced")]
    assert silenced_lines == [f"[compile-child] {GUARDS_TRACER_WARNING.why}"]


def test_data_dependent_control_flow_keeps_its_tracer_warning(capsys: pytest.CaptureFixture[str]) -> None:
    ids, mask = _inputs(2, 8)
    # The warning is shown again through warnings.showwarning, which pytest.warns records (the child prints it).
    with pytest.warns(torch.jit.TracerWarning, match="Converting a tensor to a Python boolean") as shown:
        traced = trace_bucket(Branchy(), [ids, mask], set())
    assert {Path(w.filename).name for w in shown if w.category is torch.jit.TracerWarning} == {"test_cpu.py"}
    assert f"[compile-child] {TRACER_WARNING_EXPLAINED}" in capsys.readouterr().out
    assert torch.equal(traced(ids, torch.zeros_like(mask)), ids * 2)  # the branch of the example, frozen
    # Even with the exported program's guard filter on, the model's own warning still shows: the filter
    # matches the warning only when torch._assert (module torch) issues it.
    with (pytest.warns(torch.jit.TracerWarning, match="Converting a tensor to a Python boolean"),
          silenced([GUARDS_TRACER_WARNING]), kept_tracer_warnings()):
        torch.jit.trace(Branchy(), (ids, mask))
    assert capsys.readouterr().out.count(TRACER_WARNING_EXPLAINED) == 1


def test_an_exported_program_reading_tensor_values_is_flagged(tmp_path: Path, model_files: dict[str, Path]) -> None:
    run = run_child(tmp_path, "first-tokens", model_path=str(model_files["first-tokens"]), inputs=text_inputs(2, 8))
    _assert_ok(run)  # right at the example inputs, so it compiles; the log says what the trace froze
    assert "[compile-child] warning: the model reads tensor values into Python numbers (item)" in run.stdout
    assert _warnings(run.lines) == [], run.stderr
