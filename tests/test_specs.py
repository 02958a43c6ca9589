"""Model and machine specs: parameter counts against public figures and against transformers,
node.yaml parsing with units, and errors that say what is wrong, where, and what to do."""

import json

import pytest

from hetplan.errors import HetplanError
from hetplan.hardware import load_node
from hetplan.frontends.hf_config import spec_from_config
from hetplan.frontends.resolve import load_model
from hetplan.presets.models import model_preset
from hetplan.units import parse_bandwidth, parse_bytes, parse_flops
from hetplan.workload import Workload


@pytest.mark.parametrize("name,public", [
    ("llama-3.1-8b", 8.03e9), ("llama-3.1-70b", 70.6e9), ("qwen2.5-72b", 72.7e9),
    ("mixtral-8x7b", 46.7e9), ("qwen3-30b-a3b", 30.5e9), ("deepseek-v3", 671e9),
    ("opt-175b", 175e9), ("gpt2", 124e6),
])
def test_preset_parameter_count_matches_the_published_size(name, public):
    assert model_preset(name).total_params() == pytest.approx(public, rel=0.01)


# -- every family's config.json, counted by transformers itself -------------------------------

_SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _hf_configs():
    import transformers as T

    return {
        "llama": lambda: T.LlamaConfig(**_SMALL),
        "llama-tied-biased": lambda: T.LlamaConfig(**_SMALL, tie_word_embeddings=True, attention_bias=True,
                                                   mlp_bias=True),
        "mistral": lambda: T.MistralConfig(**_SMALL),
        "qwen2": lambda: T.Qwen2Config(**_SMALL),
        "qwen3": lambda: T.Qwen3Config(**_SMALL, head_dim=24),
        "mixtral": lambda: T.MixtralConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**_SMALL, head_dim=24, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32),
        "deepseek_v3": lambda: T.DeepseekV3Config(
            vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=2,
            topk_group=1, max_position_embeddings=128),
        "opt": lambda: T.OPTConfig(vocab_size=97, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "gpt2": lambda: T.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                     bos_token_id=1, eos_token_id=2),
    }


FAMILIES = ["llama", "llama-tied-biased", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe",
            "deepseek_v3", "opt", "gpt2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_config_parses_and_counts_the_parameters_transformers_builds(family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = _hf_configs()[family]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    # parameters() yields a tied embedding once; total_params counts a tied head once too
    expected = sum(p.numel() for p in model.parameters())
    spec = spec_from_config(json.loads(json.dumps(cfg.to_dict())), name=family)
    assert spec.arch == cfg.model_type
    assert spec.total_params() == expected


def test_config_file_on_disk_loads_like_the_dict(tmp_path):
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=97, torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model(str(tmp_path))
    assert (spec.n_layers, spec.hidden, spec.n_kv_heads, spec.head_dim) == (2, 64, 2, 16)
    assert spec.weight_dtype == "bf16"
    assert load_model(str(tmp_path / "config.json"), weight_dtype="q4_0").weight_dtype == "q4_0"


# -- node.yaml ---------------------------------------------------------------------------------

NODE = """\
name: box
gpus:
  - name: G
    memory: 24GiB
    mem_bandwidth: 1008GB/s
    flops: {fp16: 165TFLOPS, fp32: 82.6TFLOPS}
cpu:
  name: C
  cores: 24
  memory: 64GiB
  mem_bandwidth: 89.6GB/s
  flops: {fp32: 1.2TFLOPS}
links:
  h2d: 25GB/s
reserve: {gpu: 1GiB, cpu: 4GiB}
efficiency: {link: 0.8}
"""


def _node(tmp_path, text, name="node.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_node_yaml_units_become_si_numbers(tmp_path):
    hw = load_node(_node(tmp_path, NODE))
    assert hw.gpu.memory_bytes == 24 * 2**30
    assert hw.gpu.mem_bytes_per_s == 1008e9
    assert hw.gpu.flops_per_s == {"fp16": 165e12, "fp32": 82.6e12}
    assert hw.cpu.memory_bytes == 64 * 2**30 and hw.cpu.cores == 24
    assert hw.cpu.mem_bytes_per_s == pytest.approx(89.6e9)
    assert hw.h2d_bytes_per_s == 25e9 and hw.d2h_bytes_per_s == 25e9  # d2h defaults to h2d
    assert hw.gpu_budget_bytes() == 23 * 2**30 and hw.cpu_budget_bytes() == 60 * 2**30
    from hetplan.presets.device_classes import CLASS_DEFAULTS
    assert hw.efficiency["link"] == 0.8 and hw.efficiency["gpu_mem"] == CLASS_DEFAULTS["consumer"]["gpu_mem"]  # default kept



def test_exponent_without_a_dot_is_a_number(tmp_path):
    """YAML 1.1 reads ``5e-6`` as a string; node.yaml takes it as the number a user wrote."""
    hw = load_node(_node(tmp_path, NODE + "latency: {gpu_task: 5e-6, cpu_task: 2E-5}\n"))
    assert hw.latency_s["gpu_task"] == 5e-6 and hw.latency_s["cpu_task"] == 2e-5
    with pytest.raises(HetplanError, match="gpu_task"):
        load_node(_node(tmp_path, NODE + "latency: {gpu_task: 5e-6s}\n", "bad.yaml"))

def test_node_without_gpus_is_cpu_only(tmp_path):
    text = "name: cpu-box\ncpu: {memory: 32GB, mem_bandwidth: 50GB/s, flops: {fp32: 1TFLOPS}}\n"
    hw = load_node(_node(tmp_path, text))
    assert hw.gpu is None and hw.gpu_budget_bytes() == 0
    assert hw.cpu_budget_bytes() == 32 * 10**9 - 4 * 2**30


@pytest.mark.parametrize("text,parse,value", [
    ("24GiB", parse_bytes, 24 * 2**30), ("64GB", parse_bytes, 64e9), ("512MiB", parse_bytes, 2**29),
    ("1.5e3B", parse_bytes, 1500), ("25GB/s", parse_bandwidth, 25e9), ("936 GB/s", parse_bandwidth, 936e9),
    ("165TFLOPS", parse_flops, 165e12), ("0.6TFLOPS", parse_flops, 0.6e12),
])
def test_units_parse_decimal_and_binary_prefixes(text, parse, value):
    assert parse(text) == pytest.approx(value)


# -- errors name what, where, and what to do ----------------------------------------------------

def test_missing_node_key_is_named(tmp_path):
    with pytest.raises(HetplanError, match=r"node\.yaml: missing key 'cpu\.memory'"):
        load_node(_node(tmp_path, NODE.replace("  memory: 64GiB\n", "")))


def test_unreadable_unit_names_the_key(tmp_path):
    with pytest.raises(HetplanError, match=r"gpus\[0\]\.mem_bandwidth: cannot read '1008 furlongs'"):
        load_node(_node(tmp_path, NODE.replace("1008GB/s", "1008 furlongs")))


def test_malformed_yaml_names_file_and_line(tmp_path):
    with pytest.raises(HetplanError, match=r"bad\.yaml:\d+:\d+: malformed YAML"):
        load_node(_node(tmp_path, NODE + "latency: {gpu_task: 1\n  x: [\n", name="bad.yaml"))


def test_malformed_json_names_file_and_line(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "llama",\n "hidden_size": 64,\n "vocab_size": }\n')
    with pytest.raises(HetplanError, match=r"config\.json:3:\d+: malformed JSON"):
        load_model(str(p))


def test_non_positive_sizes_are_refused(tmp_path):
    with pytest.raises(HetplanError, match=r"gpus\[0\]\.memory: must be a positive"):
        load_node(_node(tmp_path, NODE.replace("24GiB", "0GiB")))
    with pytest.raises(HetplanError, match=r"efficiency\.link' must be a number in \(0, 1\]"):
        load_node(_node(tmp_path, NODE.replace("link: 0.8", "link: 0")))
    with pytest.raises(HetplanError, match=r"--batch: must be a positive integer"):
        Workload(batch=0)


def test_unknown_node_key_lists_accepted_ones(tmp_path):
    with pytest.raises(HetplanError, match=r"unknown keys \['gpu_count'\]; accepted: .*'links'"):
        load_node(_node(tmp_path, NODE + "gpu_count: 2\n"))


LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=97)


def test_unknown_architecture_lists_supported_ones():
    with pytest.raises(HetplanError, match=r"model_type 'bert' is not supported; supported: .*llama"):
        spec_from_config(dict(LLAMA, model_type="bert"), source="my/config.json")


def test_missing_config_key_is_named_with_its_file():
    cfg = {k: v for k, v in LLAMA.items() if k != "vocab_size"}
    with pytest.raises(HetplanError, match=r"my/config\.json: missing key 'vocab_size'"):
        spec_from_config(cfg, source="my/config.json")


def test_heads_that_do_not_divide_are_refused_with_the_file():
    with pytest.raises(HetplanError, match=r"my/config\.json: num_key_value_heads: 3 does not divide "
                                           r"num_attention_heads 4"):
        spec_from_config(dict(LLAMA, num_key_value_heads=3), source="my/config.json")
    with pytest.raises(HetplanError, match=r"my/config\.json: num_attention_heads: 6 does not divide "
                                           r"hidden_size 64"):
        spec_from_config(dict(LLAMA, num_attention_heads=6, num_key_value_heads=6), source="my/config.json")


def test_non_positive_model_dimension_is_refused():
    with pytest.raises(HetplanError, match=r"'num_hidden_layers' must be an integer in 1 \.\. 16777216, got 0"):
        spec_from_config(dict(LLAMA, num_hidden_layers=0), source="my/config.json")


def test_unknown_presets_list_the_known_ones():
    with pytest.raises(HetplanError, match=r"not a preset and no such file; known presets: .*llama-3\.1-8b"):
        load_model("llama-9")
    with pytest.raises(HetplanError, match=r"not a preset and no such file; known presets: .*laptop-8g"):
        load_node("laptop-9g")
    with pytest.raises(HetplanError, match=r"unknown model preset 'llama-9'; known presets: .*gpt2"):
        model_preset("llama-9")
