"""LoRA adapter files and arithmetic against PEFT 0.21.2: our folders load in PEFT with the same
tensors, PEFT's load here with the same arrays, the init draws what PEFT draws, the merge is
PEFT's `merge_and_unload`, and each bad input is one line."""

import json

import numpy as np
import pytest
from hf_tiny import make_hf
from lora_tiny import make_peft, peft, peft_tensors, torch

from anelm.errors import AnelmError, UsageError
from anelm.models.adapters import Adapter, LoraSpec, check_spec, init_adapter, merge_weights, resolve_targets
from anelm.models.formats.peft import load_peft, save_peft
from anelm.models.errors import AdapterError
from anelm.models.loading import architecture, load_model

KINDS = ["llama-gqa", "qwen3-untied", "gpt2"]


def fresh_hf(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """kind -> (folder, config, weights) of a saved tiny HF model."""
    root = tmp_path_factory.mktemp("lora-bases")
    out = {}
    for i, kind in enumerate(KINDS + ["llama-mha"]):
        make_hf(kind, root / kind, seed=i)
        config, weights, _ = load_model(root / kind)
        out[kind] = (root / kind, config, weights)
    return out


def random_adapter(config, targets, rank=4, seed=1) -> Adapter:
    a = init_adapter(config, LoraSpec(rank, 2.0 * rank, 0.0, targets, "tiny"), seed)
    rng = np.random.default_rng(seed)
    for k, (A, B) in a.tensors.items():
        a.tensors[k] = (A, (0.2 * rng.standard_normal(B.shape)).astype(np.float32))
    return a


@pytest.mark.parametrize("kind", KINDS)
def test_peft_loads_our_folder_with_identical_tensors(bases, kind, tmp_path):
    folder, config, _ = bases[kind]
    ours = random_adapter(config, resolve_targets(config, "all-linear"))
    save_peft(ours, tmp_path / "adapter")
    model = peft.PeftModel.from_pretrained(fresh_hf(folder), tmp_path / "adapter")
    theirs = peft_tensors(model)
    assert set(theirs) == set(ours.tensors)
    for k, (a, b) in ours.tensors.items():
        np.testing.assert_array_equal(theirs[k][0], a)
        np.testing.assert_array_equal(theirs[k][1], b)
    assert model.peft_config["default"].lora_alpha == ours.spec.alpha
    assert model.peft_config["default"].fan_in_fan_out == (kind == "gpt2")


@pytest.mark.parametrize("kind", KINDS)
def test_we_load_a_folder_peft_wrote(bases, kind, tmp_path):
    folder, config, _ = bases[kind]
    model = make_peft(fresh_hf(folder), kind, tmp_path / "adapter", rank=3, alpha=5.0)
    got = load_peft(tmp_path / "adapter", config)
    want = peft_tensors(model)
    assert set(got.tensors) == set(want) and got.rank == 3 and got.spec.scale == pytest.approx(5.0 / 3)
    for k, (a, b) in want.items():
        np.testing.assert_array_equal(got.tensors[k][0], a)
        np.testing.assert_array_equal(got.tensors[k][1], b)


def test_keys_with_the_adapter_name_and_run_folders_load(bases, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, config, _ = bases["llama-gqa"]
    ours = random_adapter(config, ("q_proj", "v_proj"))
    save_peft(ours, tmp_path / "run" / "adapter")  # a finetune RUN folder
    f = tmp_path / "run" / "adapter" / "adapter_model.safetensors"
    save_file({k.replace(".weight", ".default.weight"): v for k, v in load_file(f).items()}, str(f))
    got = load_peft(tmp_path / "run", config)
    for k, (a, b) in ours.tensors.items():
        np.testing.assert_array_equal(got.tensors[k][1], b)


@pytest.mark.parametrize("kind", ["llama-gqa", "gpt2"])
def test_init_draws_what_peft_draws(bases, kind):
    """PEFT: A ~ kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0."""
    folder, config, _ = bases[kind]
    targets = tuple(t for t in resolve_targets(config, "all-linear"))
    model = peft.get_peft_model(fresh_hf(folder), peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(targets)))
    theirs, ours = peft_tensors(model), init_adapter(config, LoraSpec(8, 16.0, 0.0, targets), seed=3).tensors
    assert set(theirs) == set(ours)
    for k, (a, b) in ours.items():
        ta, tb = theirs[k]
        bound = 1 / np.sqrt(a.shape[1])
        assert a.shape == ta.shape and b.shape == tb.shape
        assert not b.any() and not tb.any()
        for arr in (a, ta):  # uniform on [-bound, bound]: reaches near both ends, std bound/sqrt(3)
            assert np.abs(arr).max() <= bound and arr.max() > 0.8 * bound and arr.min() < -0.8 * bound
            assert arr.std() == pytest.approx(bound / np.sqrt(3), rel=0.25)
    assert not np.array_equal(ours[k][0], init_adapter(config, LoraSpec(8, 16.0, 0.0, targets), seed=4).tensors[k][0])


@pytest.mark.parametrize("kind", KINDS)
def test_merge_equals_peft_merge_and_unload(bases, kind, tmp_path):
    folder, config, weights = bases[kind]
    make_peft(fresh_hf(folder), kind, tmp_path / "adapter", seed=5)
    merged_hf = peft.PeftModel.from_pretrained(fresh_hf(folder), tmp_path / "adapter").merge_and_unload()
    arch = architecture(config.model_type)
    want = arch.sanitize({k: v.detach().numpy() for k, v in merged_hf.state_dict().items()}, config)
    got = merge_weights(weights, load_peft(tmp_path / "adapter", config))
    changed = 0
    for k in arch.expected_shapes(config):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)
        changed += not np.array_equal(got[k], weights[k])
    assert changed == len(load_peft(tmp_path / "adapter", config).tensors) > 0  # exactly the targeted weights


def write_config(folder, **override):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((folder / "adapter_config.json").read_text()) if (folder / "adapter_config.json").exists() else {}
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **override}))


@pytest.mark.parametrize("override, expected", [
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not LoRA"),
    ({"r": 0}, "rank r=0: expected an integer r >= 1"),
    ({"target_modules": ["c_attn"]}, "target module 'c_attn', which the llama base lacks"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_bad_adapter_configs_are_one_line(bases, tmp_path, override, expected):
    _, config, _ = bases["llama-gqa"]
    save_peft(random_adapter(config, ("q_proj",)), tmp_path / "a")
    write_config(tmp_path / "a", **override)
    with pytest.raises(AdapterError, match=expected) as e:
        load_peft(tmp_path / "a", config)
    assert "\n" not in str(e.value)


def test_an_adapter_for_another_base_is_refused(bases, tmp_path):
    _, gqa, _ = bases["llama-gqa"]
    _, mha, _ = bases["llama-mha"]
    save_peft(random_adapter(gqa, ("q_proj", "v_proj")), tmp_path / "a")
    with pytest.raises(AdapterError, match=r"v_proj has lora_A \[4, 64\] and lora_B \[16, 4\], expected "
                                           r"\[4, 64\] and \[64, 4\]: an adapter for another base"):
        load_peft(tmp_path / "a", mha)
    _, gpt2, _ = bases["gpt2"]
    with pytest.raises(AdapterError, match="which the gpt2 base lacks"):
        load_peft(tmp_path / "a", gpt2)


def test_rank_beyond_the_layer_width_and_unknown_targets(bases):
    _, config, _ = bases["llama-gqa"]  # v_proj: 2 KV heads x 8 = 16 outputs
    check_spec(config, LoraSpec(16, 1.0, 0.0, ("q_proj", "v_proj")))
    with pytest.raises(AdapterError, match=r"rank 17 does not fit: expected 1 <= rank <= 16 \(the width of v_proj\)"):
        check_spec(config, LoraSpec(17, 1.0, 0.0, ("q_proj", "v_proj")))
    with pytest.raises(AdapterError, match="rank 0 does not fit"):
        init_adapter(config, LoraSpec(0, 1.0, 0.0, ("q_proj",)))
    with pytest.raises(UsageError, match="unknown target module 'c_attn' for a llama model: expected a "
                                         "comma-separated list of q_proj, k_proj, v_proj, o_proj, gate_proj"):
        resolve_targets(config, "q_proj,c_attn")
    assert resolve_targets(config, None) == ("q_proj", "v_proj")
    assert resolve_targets(config, "v_proj, q_proj") == ("q_proj", "v_proj")
    assert resolve_targets(bases["gpt2"][1], None) == ("c_attn",)
    assert resolve_targets(bases["gpt2"][1], "all-linear") == ("c_attn", "c_proj", "c_fc")


def test_missing_files_are_one_line(bases, tmp_path):
    _, config, _ = bases["llama-gqa"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json in .*empty: expected a PEFT LoRA folder"):
        load_peft(tmp_path / "empty", config)
    save_peft(random_adapter(config, ("q_proj",)), tmp_path / "a")
    (tmp_path / "a" / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors in"):
        load_peft(tmp_path / "a", config)
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(AnelmError, match="not a readable safetensors file"):
        load_peft(tmp_path / "a", config)


def test_save_is_atomic_and_replaces_the_folder(bases, tmp_path):
    _, config, _ = bases["llama-gqa"]
    first, second = random_adapter(config, ("q_proj",), seed=1), random_adapter(config, ("q_proj",), seed=2)
    save_peft(first, tmp_path / "a")
    save_peft(second, tmp_path / "a")
    got = load_peft(tmp_path / "a", config)
    k = next(iter(second.tensors))
    np.testing.assert_array_equal(got.tensors[k][1], second.tensors[k][1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temp folder left behind
