"""``export_hf``: tiny random checkpoints exported per rank, run with real onnxruntime and
per-rank KV caches, against a float64 numpy forward of the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hf_checkpoints import CONFIGS, random_weights, reference_logits, write_checkpoint
from hf_runner import PackedModel

from shardserve.errors import ExportError
from shardserve.repo.repository import AttentionOp, load_group
from shardserve.text.tokenizer import TextModel
from shardserve.tools.export.hf import export_hf

PROMPTS = {"a": [5, 17, 33, 2, 9, 41, 7], "b": [11, 3, 60]}
NEW_TOKENS = 8
LAYOUTS = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2)]
FUSED_LAYOUTS = [(1, 1), (2, 1), (2, 2)]  # composed pieces (attention in onnxruntime)
# Composed pieces against the segment-by-segment run: GroupQueryAttention and numpy sum in
# another order; measured <= 1.4e-5 on logits up to ~7 (a few float32 ulps).
FUSED_ATOL = 2e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        kind: write_checkpoint(
            root / kind, kind, random_weights(kind), shards=2 if kind == "llama" else 1
        )
        for kind in CONFIGS
    }


def exported(
    checkpoint: Path, out: Path, tp: int, pp: int, *, fused: bool = False, **kw: object
) -> PackedModel:
    name = f"m{tp}x{pp}"
    export_hf(checkpoint, out, rank_size=tp * pp, stage_size=pp, name=name, **kw)  # type: ignore[arg-type]
    return PackedModel(out, name, fused=fused)


def reference_greedy(kind: str, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    weights, tokens = random_weights(kind), list(prompt)
    for _ in range(NEW_TOKENS):
        tokens.append(int(np.argmax(reference_logits(kind, weights, tokens)[-1])))
    return tokens[len(prompt) :], reference_logits(kind, weights, tokens)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_prefill_and_every_decode_step_match_the_reference(
    kind: str, tp: int, pp: int, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model = exported(checkpoints[kind], tmp_path, tp, pp)
    prompt = PROMPTS["a"]
    tokens, logits = model.generate(1, prompt, NEW_TOKENS)
    expected_tokens, expected = reference_greedy(kind, prompt)
    assert tokens == expected_tokens
    np.testing.assert_allclose(logits[0], expected[: len(prompt)], atol=1e-4)
    for step, decoded in enumerate(logits[1:-1]):
        np.testing.assert_allclose(decoded[0], expected[len(prompt) + step], atol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_sequences_of_different_lengths_share_steps(
    kind: str, fused: bool, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Prefill b while a decodes, then decode both in one step: each equals its alone-run
    (fused: alone runs whole composed pieces, shared steps their segments one by one)."""
    atol = FUSED_ATOL if fused else 1e-5
    model = exported(checkpoints[kind], tmp_path, 2, 1, fused=fused)
    a, b = PROMPTS["a"], PROMPTS["b"]
    _, alone_a = model.generate(1, a, 2)
    _, alone_b = model.generate(2, b, 1)
    model.reserve(3, len(a) + 2)
    model.reserve(4, len(b) + 1)
    model.step([(3, 0, len(a))], a)
    next_a = int(np.argmax(alone_a[0][-1]))
    mixed = model.step([(4, 0, len(b)), (3, len(a), 1)], [*b, next_a])
    np.testing.assert_allclose(mixed[: len(b)], alone_b[0], atol=atol)
    np.testing.assert_allclose(mixed[len(b) :], alone_a[1], atol=atol)
    next_b = int(np.argmax(alone_b[0][-1]))
    both = model.step(
        [(3, len(a) + 1, 1), (4, len(b), 1)], [int(np.argmax(alone_a[1][0])), next_b], [1, 0]
    )
    np.testing.assert_allclose(both[0], alone_b[1][0], atol=atol)
    np.testing.assert_allclose(both[1], alone_a[2][0], atol=atol)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_sliced_equals_unsliced(kind: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    whole = exported(checkpoints[kind], tmp_path, 1, 1)
    sliced = exported(checkpoints[kind], tmp_path, 4, 2)
    for model in (whole, sliced):
        model.reserve(1, 16)
    ids = PROMPTS["a"]
    np.testing.assert_allclose(
        sliced.step([(1, 0, len(ids))], ids), whole.step([(1, 0, len(ids))], ids), atol=1e-5
    )


def test_bf16_checkpoint_is_widened_and_said(tmp_path: Path) -> None:
    weights = random_weights("llama")
    folder = write_checkpoint(tmp_path / "bf16", "llama", weights, dtype=ml_dtypes.bfloat16)
    lines: list[str] = []
    model = exported(folder, tmp_path / "repo", 2, 1, progress=lines.append)
    assert "converted bf16 -> fp32" in lines
    widened = {n: a.astype(ml_dtypes.bfloat16).astype(np.float32) for n, a in weights.items()}
    model.reserve(1, 8)
    ids = PROMPTS["a"]
    got = model.step([(1, 0, len(ids))], ids)
    np.testing.assert_allclose(got, reference_logits("llama", widened, ids), atol=1e-4)


def test_repository_layout_tokenizer_and_determinism(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    lines: list[str] = []
    export_hf(
        checkpoints["qwen2"], tmp_path / "one", rank_size=2, stage_size=2, progress=lines.append
    )
    export_hf(checkpoints["qwen2"], tmp_path / "two", rank_size=2, stage_size=2)
    first = (tmp_path / "one/qwen2/1/group.json").read_text()
    assert first == (tmp_path / "two/qwen2/1/group.json").read_text()
    assert [line for line in lines if line.startswith("rank ")][:2] == [
        line for line in lines if line.startswith(("rank 0/2", "rank 1/2"))
    ]
    group = load_group(tmp_path / "one", "qwen2", 1)
    token_file = tmp_path / "one/qwen2/1/tokenizer/tokenizer.json"
    assert token_file.is_file() and "tokenizer/tokenizer.json" in group.origin
    assert group.origin["eos_token_ids"] == "3,4"
    assert [s.inputs for s in group.stages] == [
        ("input_ids", "positions", "logit_rows"),
        ("hidden.1", "positions", "logit_rows"),
    ]
    attention = [op.layer for s in group.stages for op in s.program if isinstance(op, AttentionOp)]
    assert attention == [0, 1]
    config = (tmp_path / "one/qwen2/servable_config.py").read_text()
    assert "generation=True" in config and "register_method" not in config


# ---------------------------------------------------------------- refusals


def refused(checkpoint: Path, out: Path, match: str, **kw: int) -> None:
    with pytest.raises(ExportError, match=match):
        export_hf(checkpoint, out, name="bad", **kw)  # type: ignore[arg-type]
    assert not (out / "bad").exists(), "a failed export must leave no servable folder"


def test_missing_tensor_is_refused(tmp_path: Path) -> None:
    weights = random_weights("llama")
    del weights["model.layers.2.mlp.up_proj.weight"]
    folder = write_checkpoint(tmp_path / "ck", "llama", weights)
    refused(folder, tmp_path / "repo", "has no tensor 'model.layers.2.mlp.up_proj.weight'")


def test_shape_disagreeing_with_config_is_refused(tmp_path: Path) -> None:
    weights = random_weights("gpt2")
    weights["transformer.h.1.mlp.c_fc.weight"] = weights["transformer.h.1.mlp.c_fc.weight"][:, :200]
    folder = write_checkpoint(tmp_path / "ck", "gpt2", weights)
    refused(
        folder,
        tmp_path / "repo",
        r"c_fc.weight' .* shape \[64, 200\], config.json implies \[64, 256\]",
    )


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "ck", "llama", random_weights("llama"), shards=2)
    shard = folder / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    refused(folder, tmp_path / "repo", "model-00002-of-00002.safetensors is damaged or truncated")


def test_index_naming_a_missing_shard_is_refused(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "ck", "llama", random_weights("llama"), shards=2)
    (folder / "model-00001-of-00002.safetensors").unlink()
    refused(folder, tmp_path / "repo", r"names shard\(s\) missing .*model-00001-of-00002")


def test_other_architectures_are_refused_naming_the_supported(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "ck", "gpt2", random_weights("gpt2"))
    (folder / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    refused(folder, tmp_path / "repo", r"\['FalconForCausalLM'\] is not supported; supported: GPT2")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"rank_size": 3}, "4 attention heads do not divide over 3 ranks"),
        ({"rank_size": 8}, "4 attention heads do not divide over 8 ranks"),
        ({"rank_size": 5, "stage_size": 5}, "4 layers cannot fill 5 pipeline stages"),
    ],
)
def test_impossible_layouts_are_refused(
    kw: dict[str, int], match: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    refused(checkpoints["llama"], tmp_path / "repo", match, **kw)


# ---------------------------------------------------------------- against transformers itself

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hf"


def fixture_cases() -> list[tuple[str, int, int, bool]]:
    kinds = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.json").is_file())
    layouts = [(*layout, False) for layout in LAYOUTS] + [(*lay, True) for lay in FUSED_LAYOUTS]
    return [(kind, tp, pp, fused) for kind in kinds for tp, pp, fused in layouts]


@pytest.mark.parametrize(("kind", "tp", "pp", "fused"), fixture_cases())
def test_logits_and_greedy_tokens_equal_transformers(
    kind: str, tp: int, pp: int, fused: bool, tmp_path: Path
) -> None:
    """Prefill logits and every decode step's logits (<= 1e-4), greedy ids identical
    (fused: every step of one sequence runs the ranks' composed pieces whole)."""
    from safetensors.numpy import load_file

    folder = FIXTURES / kind
    reference = json.loads((folder / "reference.json").read_text())
    arrays = load_file(str(folder / "reference.safetensors"))
    # every fixture divides at every layout here
    model = exported(folder, tmp_path, tp, pp, fused=fused)
    for index, prompt in enumerate(reference["prompts"]):
        ids, greedy = prompt["input_ids"], prompt["greedy_ids"]
        tokens, logits = model.generate(index, ids, len(greedy))
        assert tokens == greedy
        np.testing.assert_allclose(logits[0], arrays[f"prompt{index}.prefill_logits"], atol=1e-4)
        decode = np.concatenate([logits[0][-1:], *logits[1:-1]])
        np.testing.assert_allclose(decode, arrays[f"prompt{index}.decode_logits"], atol=1e-4)


def test_a_checkpoint_without_a_usable_tokenizer_is_refused(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "ck", "llama", random_weights("llama"))
    (folder / "tokenizer.json").unlink()
    refused(folder, tmp_path / "repo", r"has no usable tokenizer \(bad: no tokenizer.json in ")
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    refused(
        folder, tmp_path / "repo", r"has no usable tokenizer .* does not load: .*save_pretrained"
    )


def test_chat_template_jinja_is_exported_and_used(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "ck", "llama", random_weights("llama"))
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    (folder / "chat_template.jinja").write_text(template)
    export_hf(folder, tmp_path / "repo", name="chatty")
    text = TextModel.load(tmp_path / "repo/chatty/1/tokenizer", "chatty")
    assert text.render_chat([{"role": "user", "content": "Hi"}]) == "<user>Hi<assistant>"
