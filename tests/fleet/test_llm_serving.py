"""The serving check: NxD Inference's neuron_config.json (shaped as NxDI writes it) against vLLM's arguments.
Matching arguments pass; every mismatch is refused with its one line; the weights must be where NxDI will look."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from compilesvc.fleet import (
    LLMArtifact,
    NeuronConfigUnreadable,
    NotAnLLMArtifact,
    ServingArgsError,
    ServingDirRefused,
    check_serving,
    make_serving_dir,
    parse_vllm_args,
    vllm_environment,
    vllm_serving_args,
)
from tests.fleet.nxdi_files import (
    LLAMA_31_8B,
    compiled_files,
    inference_config,
    write_checkpoint,
    write_compiled,
)

#: What a fleet serving the default artifact (tp 8, batch 4, seq_len 2048, bfloat16) passes vLLM.
MATCHING = ["--tensor-parallel-size", "8", "--max-num-seqs", "4", "--max-model-len", "2048", "--dtype", "bfloat16"]


def artifact(tmp_path: Path, *, shards: int = 8, **neuron: Any) -> LLMArtifact:
    if shards:
        neuron.setdefault("save_sharded_checkpoint", True)
    directory = write_compiled(tmp_path / "bucket-0", compiled_files(inference_config(**neuron), shards=shards))
    return LLMArtifact.from_directory(directory, key="9" * 64)


def refusals(art: LLMArtifact, *argv: str) -> list[str]:
    return check_serving(art, parse_vllm_args(argv))


def test_the_document_is_read_as_nxdi_writes_it(tmp_path: Path) -> None:
    art = artifact(tmp_path)
    raw = (art.directory / "neuron_config.json").read_text()
    assert raw.startswith('{\n  "_name_or_path": ') and '"quantize_clamp_bound": Infinity' in raw  # json.dumps
    assert art.neuron_config["tp_degree"] == 8 and art.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert "neuron_config" not in art.hf_config and art.name_or_path == "/tmp/compilesvc-work/checkpoint"
    assert art.presharded and art.missing_shards() == []
    assert art.compiled_model_path == tmp_path / "bucket-0"
    assert vllm_environment(art) == {"NEURON_COMPILED_ARTIFACTS": str(tmp_path / "bucket-0"),
                                     "VLLM_NEURON_FRAMEWORK": "neuronx-distributed-inference"}
    assert vllm_serving_args(art) == MATCHING


def test_the_matching_arguments_pass_and_the_printed_ones_too(tmp_path: Path) -> None:
    art = artifact(tmp_path)
    assert refusals(art, *MATCHING) == []
    assert refusals(art, "serve", "meta-llama/Llama-3.1-8B", *vllm_serving_args(art)) == []
    # Bounds: fewer sequences than KV rows are padded; a shorter max length fits every bucket.
    assert refusals(art, "--tensor_parallel_size", "8", "--max-num-seqs=2", "--max-model-len=1k", "--dtype", "bfloat16",
                    "--block-size", "32") == []  # vLLM sets block_size = max_model_len itself without block KV
    # An override that restates the compiled value says nothing new; other vLLM options are not ours.
    assert refusals(art, *MATCHING, "--override-neuron-config", '{"batch_size": 4}', "--port", "8000",
                    "--no-enable-chunked-prefill", "--trust-remote-code") == []


@pytest.mark.parametrize(("argv", "line"), [
    (["--tensor-parallel-size", "4"], "--tensor-parallel-size 4 but the artifact was compiled for tp_degree 8"),
    (["-tp", "16"], "--tensor-parallel-size 16 but the artifact was compiled for tp_degree 8"),
    (["--max-num-seqs", "8"], "--max-num-seqs 8 but the artifact was compiled for batch_size 4 (sequence ids beyond "
                              "the compiled KV cache rows)"),
    (["--max-model-len", "4096"], "--max-model-len 4096 but the artifact was compiled for seq_len 2048"),
    (["--dtype", "float16"], "--dtype float16 but the artifact was compiled for torch_dtype bfloat16"),
    (["--dtype", "half"], "--dtype half but the artifact was compiled for torch_dtype bfloat16"),
    (["--dtype", "int8"], "--dtype int8 is not a dtype vLLM's Neuron path maps (expected one of half, float16, "
                          "bfloat16, float, float32)"),
    (["--enable-prefix-caching"], "--enable-prefix-caching is on but the artifact was compiled with "
                                  "is_prefix_caching False"),
    (["--num-speculative-tokens", "5"], "--num-speculative-tokens 5 but the artifact was compiled without fused "
                                        "speculation"),
    (["--speculative-config", '{"num_speculative_tokens": 3, "model": "/d"}'],
     "--num-speculative-tokens 3 but the artifact was compiled without fused speculation"),
    (["--override-neuron-config", '{"batch_size": 8}'],
     "--override-neuron-config sets batch_size=8 but the artifact was compiled with batch_size=4"),
    (["--additional-config", '{"override_neuron_config": {"sequence_parallel_enabled": false}}'],
     "--override-neuron-config sets sequence_parallel_enabled=false but the artifact was compiled with "
     "sequence_parallel_enabled=true"),
])
def test_each_mismatch_is_refused_with_its_line(tmp_path: Path, argv: list[str], line: str) -> None:
    art = artifact(tmp_path)
    given = dict(zip(MATCHING[::2], MATCHING[1::2], strict=True))
    for name in ("--tensor-parallel-size", "--max-num-seqs", "--max-model-len", "--dtype"):
        if name in argv or (name == "--tensor-parallel-size" and "-tp" in argv):
            given.pop(name)
    rest = [token for pair in given.items() for token in pair]
    assert refusals(art, *rest, *argv) == [line]


def test_what_vllm_would_choose_itself_is_refused_with_what_to_pass(tmp_path: Path) -> None:
    art = artifact(tmp_path)
    assert refusals(art, "--dtype", "bfloat16") == [
        "--tensor-parallel-size is not given (vLLM's default 1) but the artifact was compiled for tp_degree 8",
        "--max-num-seqs is not given: vLLM would pick its own default (32 with vllm-neuron, platform.py:L195-L197; "
        "256 in V0); pass --max-num-seqs 4",
        "--max-model-len is not given: vLLM would take the model's max_position_embeddings; pass --max-model-len 2048",
    ]
    # "auto" is the checkpoint's dtype: bfloat16 here, so it matches; a float32 checkpoint is not certain.
    assert refusals(art, *MATCHING[:6]) == [] and refusals(art, *MATCHING[:6], "--dtype", "auto") == []
    f32 = artifact(tmp_path / "f32", hf={**LLAMA_31_8B, "torch_dtype": "float32"})
    assert refusals(f32, *MATCHING[:6]) == ["--dtype is auto (or not given) and the checkpoint's torch_dtype is "
                                            "float32: vLLM's choice is not certain; pass --dtype bfloat16"]


def test_prompts_longer_than_the_context_encoding_are_refused(tmp_path: Path) -> None:
    art = artifact(tmp_path, seq_len=4096, max_context_length=1024)
    assert vllm_serving_args(art)[4:6] == ["--max-model-len", "1024"]
    args = ["--tensor-parallel-size", "8", "--max-num-seqs", "4", "--dtype", "bfloat16"]
    assert refusals(art, *args, "--max-model-len", "4096") == [
        "--max-model-len 4096 but the artifact's context encoding takes at most max_context_length 1024 tokens "
        "(longer prompts fail in NxDI)"]
    assert refusals(art, *args, "--max-model-len", "1024") == []
    truncating = artifact(tmp_path / "t", seq_len=4096, max_context_length=1024, allow_input_truncation=True)
    assert refusals(truncating, *args, "--max-model-len", "4096") == []


def test_a_prefix_caching_artifact_needs_its_block_layout(tmp_path: Path) -> None:
    art = artifact(tmp_path, is_prefix_caching=True, is_block_kv_layout=True, pa_block_size=32, pa_num_blocks=256)
    assert vllm_serving_args(art)[-3:] == ["--enable-prefix-caching", "--block-size", "32"]
    assert refusals(art, *vllm_serving_args(art)) == []
    assert refusals(art, *MATCHING) == [
        "--enable-prefix-caching is off but the artifact was compiled with is_prefix_caching True",
        "--block-size is not given but the artifact was compiled with a block KV cache of pa_block_size 32"]
    assert refusals(art, *MATCHING, "--enable-prefix-caching", "--block-size", "16") == [
        "--block-size 16 but the artifact was compiled with a block KV cache of pa_block_size 32"]
    assert refusals(art, *MATCHING[:4], "--max-model-len", "1024", "--dtype", "bfloat16", "--enable-prefix-caching",
                    "--block-size", "32") == [
        "--max-model-len 1024 but the artifact was compiled with a block KV cache for seq_len 2048 (block tables "
        "must be 2048 tokens wide)"]
    few = artifact(tmp_path / "few", is_prefix_caching=True, is_block_kv_layout=True, pa_block_size=32,
                   pa_num_blocks=100)
    assert refusals(few, *vllm_serving_args(few)) == [
        "--max-model-len 2048 and --max-num-seqs 4 need 256 KV blocks but the artifact was compiled with "
        "pa_num_blocks 100"]


def test_a_fused_speculation_artifact_needs_its_length(tmp_path: Path) -> None:
    art = artifact(tmp_path, enable_fused_speculation=True, speculation_length=5)
    assert refusals(art, *vllm_serving_args(art)) == []
    assert refusals(art, *MATCHING) == ["--num-speculative-tokens is not given but the artifact was compiled with "
                                        "fused speculation of speculation_length 5"]
    assert refusals(art, *MATCHING, "--num-speculative-tokens", "4") == [
        "--num-speculative-tokens 4 but the artifact was compiled with fused speculation of speculation_length 5"]


def test_every_mismatch_gets_a_line(tmp_path: Path) -> None:
    art = artifact(tmp_path)
    lines = refusals(art, "-tp", "2", "--max-num-seqs", "64", "--max-model-len", "8192", "--dtype", "float32")
    assert [line.split(" ")[0] for line in lines] == ["--tensor-parallel-size", "--max-num-seqs", "--max-model-len",
                                                      "--dtype"]


def test_a_presharded_artifact_lacking_a_rank_is_refused(tmp_path: Path) -> None:
    art = artifact(tmp_path, shards=4)  # tp 8, but only ranks 0-3 were kept
    assert refusals(art, *MATCHING) == [
        "the artifact was compiled with save_sharded_checkpoint but lacks weights/tp4_sharded_checkpoint.safetensors, "
        "weights/tp5_sharded_checkpoint.safetensors, weights/tp6_sharded_checkpoint.safetensors, "
        "weights/tp7_sharded_checkpoint.safetensors: vLLM would fail to load it and compile on this host"]


def test_a_skip_sharding_artifact_is_held_to_what_load_reads(tmp_path: Path) -> None:
    """skip_sharding stops the compile writing weights/ (NXDI@ef2731e models/application_base.py:L246-L248), yet
    load() reads them whenever save_sharded_checkpoint (L389-L399): such an artifact (not one of ours: the spec
    check refuses the combination) is refused as lacking every rank, not served as weight-free."""
    art = artifact(tmp_path, shards=0, save_sharded_checkpoint=True, skip_sharding=True)
    assert art.presharded and len(art.missing_shards()) == 8
    [line] = refusals(art, *MATCHING)
    assert line.startswith("the artifact was compiled with save_sharded_checkpoint but lacks "
                           "weights/tp0_sharded_checkpoint.safetensors")


def test_a_weight_free_artifact_needs_the_checkpoint_where_nxdi_looks(tmp_path: Path) -> None:
    art = artifact(tmp_path, shards=0)
    checkpoint = write_checkpoint(tmp_path / "llama")
    expected = (f"the artifact holds no weights (save_sharded_checkpoint false) and its _name_or_path "
                f"/tmp/compilesvc-work/checkpoint does not exist on this host: NxDI would look for them in "
                f"{art.directory}, fail, and vLLM would compile on this host; give serve-env --checkpoint CKPT "
                "--serving-dir DIR (docs/fleet.md)")
    # vLLM's --model is the HF config only: naming the checkpoint there does not put the weights where NxDI reads.
    assert refusals(art, *MATCHING, "--model", str(checkpoint)) == [expected]

    served = make_serving_dir(art, checkpoint, tmp_path / "serve")
    assert served.directory == tmp_path / "serve" and served.neuron_config == art.neuron_config
    assert os.readlink(tmp_path / "serve" / "model.pt") == str(art.directory / "model.pt")
    assert os.readlink(tmp_path / "serve" / "model.safetensors") == str(checkpoint / "model.safetensors")
    assert refusals(served, *MATCHING, "--model", str(checkpoint)) == []
    assert refusals(served, *MATCHING) == []
    other = write_checkpoint(tmp_path / "other")
    assert refusals(served, *MATCHING, "--model", str(other)) == [
        f"--model {other} but NxDI will load the weights from {checkpoint}"]
    smaller = write_checkpoint(tmp_path / "llama-1b", hf={**LLAMA_31_8B, "num_hidden_layers": 16})
    served_small = make_serving_dir(art, smaller, tmp_path / "serve")  # an earlier serving directory: replaced
    assert refusals(served_small, *MATCHING, "--model", str(smaller)) == [
        f"--model {smaller} has num_hidden_layers 16 but the artifact was compiled for 32"]

    # A _name_or_path that exists on this host wins (application_base.py:L633-L635), whatever --model says.
    at_home = artifact(tmp_path / "home", shards=0, name_or_path=str(checkpoint))
    assert refusals(at_home, *MATCHING, "--model", str(checkpoint)) == []
    assert refusals(at_home, *MATCHING, "--model", str(other)) == [
        f"--model {other} but NxDI will load the weights from {checkpoint}"]


def test_the_serving_dir_never_replaces_what_is_not_its_own(tmp_path: Path) -> None:
    art = artifact(tmp_path, shards=0)
    checkpoint = write_checkpoint(tmp_path / "llama")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ServingDirRefused, match="not empty and not an earlier serving directory"):
        make_serving_dir(art, checkpoint, mine)
    assert (mine / "notes.txt").read_text() == "mine"
    with pytest.raises(ServingDirRefused, match="is not a checkpoint directory"):
        make_serving_dir(art, tmp_path / "nowhere", tmp_path / "serve")
    made = make_serving_dir(art, checkpoint, tmp_path / "serve")
    (made.directory / "extra.bin").write_bytes(b"x")  # the user put something there: it is theirs now
    with pytest.raises(ServingDirRefused, match=r"extra\.bin, which serve-env did not make"):
        make_serving_dir(art, checkpoint, tmp_path / "serve")


def test_unreadable_arguments_and_documents_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ServingArgsError, match="--max-model-len 'abc' is not a whole number"):
        parse_vllm_args(["--max-model-len=abc"])
    assert [parse_vllm_args(["--max-model-len", v]).max_model_len for v in ("2k", "2K", "2Ki", "2048")] == [
        2000, 2048, 2048, 2048]
    with pytest.raises(ServingArgsError, match="'1M' is not a whole number"):  # 10**6 or 2**20, by vLLM release
        parse_vllm_args(["--max-model-len", "1M"])
    with pytest.raises(ServingArgsError, match="--override-neuron-config is not JSON"):
        parse_vllm_args(["--override-neuron-config", "{batch_size: 4}"])
    for argv in (["--max-num-seqs", "-1"], ["-tp", "0"], ["--max-model-len=0"], ["--block-size", "-16"],
                 ["--speculative-config", '{"num_speculative_tokens": 0}']):
        with pytest.raises(ServingArgsError, match=r"' must be at least 1$"):
            parse_vllm_args(argv)
    with pytest.raises(ServingArgsError, match="--tensor-parallel-size needs a value"):
        parse_vllm_args(["--tensor-parallel-size"])
    (tmp_path / "model.pt").write_bytes(b"m")
    with pytest.raises(NotAnLLMArtifact, match=r"has no neuron_config\.json"):
        LLMArtifact.from_directory(tmp_path)
    (tmp_path / "neuron_config.json").write_text(json.dumps({"tp_degree": 8}))  # a bare NeuronConfig, not NxDI's
    with pytest.raises(NeuronConfigUnreadable, match='has no "neuron_config" object'):
        LLMArtifact.from_directory(tmp_path)


def test_the_check_imports_no_framework() -> None:
    code = ("import sys; from compilesvc.fleet import check_serving, make_serving_dir, LLMArtifact; "
            "heavy = {'torch', 'numpy', 'sqlalchemy', 'boto3', 'neuronx_distributed_inference', 'vllm'}"
            " & set(sys.modules); print(sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
