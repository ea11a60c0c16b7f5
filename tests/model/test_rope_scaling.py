"""Rope scaling kinds against transformers' own formulas (ROPE_INIT_FUNCTIONS), from the same configs."""
import pytest
import torch
from transformers import LlamaConfig, Phi3Config, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedllm.model.config import model_config_from_hf
from pagedllm.model.rope_scaling import dynamic_ntk_inv_freq, inv_freq

SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
             num_hidden_layers=1, vocab_size=32)
LONG_FACTORS = [1.0 + 0.3 * i for i in range(32)]
SHORT_FACTORS = [1.0 + 0.01 * i for i in range(32)]
CONFIGS = {
    "yarn": Qwen2Config(**SHAPE, max_position_embeddings=32768, rope_theta=1e6,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}),
    "yarn-mscale": LlamaConfig(**SHAPE, max_position_embeddings=4096,
                               rope_scaling={"rope_type": "yarn", "factor": 16.0, "mscale": 0.707,
                                             "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2,
                                             "original_max_position_embeddings": 256}),
    "longrope": Phi3Config(**SHAPE, max_position_embeddings=131072, original_max_position_embeddings=4096,
                           rope_scaling={"rope_type": "longrope", "long_factor": LONG_FACTORS,
                                         "short_factor": SHORT_FACTORS}),
    "longrope-partial": Phi3Config(**SHAPE, max_position_embeddings=131072, original_max_position_embeddings=4096,
                                   partial_rotary_factor=0.5,
                                   rope_scaling={"rope_type": "longrope", "long_factor": LONG_FACTORS[:16],
                                                 "short_factor": SHORT_FACTORS[:16]}),
}


ARCHITECTURES = {Qwen2Config: "Qwen2ForCausalLM", LlamaConfig: "LlamaForCausalLM", Phi3Config: "Phi3ForCausalLM"}


def ours(hf_config):
    """Our ModelConfig from the config.json transformers would save."""
    return model_config_from_hf({**hf_config.to_dict(), "architectures": [ARCHITECTURES[type(hf_config)]]}, None)


@pytest.mark.parametrize("name", CONFIGS)
def test_frequencies_and_attention_factor_match_transformers(name):
    hf_config = CONFIGS[name]
    config = ours(hf_config)
    kind = config.rope_scaling["rope_type"]
    theirs, their_factor = ROPE_INIT_FUNCTIONS[kind](hf_config, torch.device("cpu"))
    torch.testing.assert_close(inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling), theirs,
                               rtol=0, atol=0)
    assert config.rope_scaling["attention_factor"] == pytest.approx(their_factor, rel=1e-12)
    if kind == "longrope":   # the long set, which transformers computes for any length past the original
        long, _ = ROPE_INIT_FUNCTIONS[kind](hf_config, torch.device("cpu"), seq_len=4097)
        torch.testing.assert_close(inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling, long=True),
                                   long, rtol=0, atol=0)


def test_dynamic_ntk_frequencies_for_each_length_match_transformers():
    hf_config = LlamaConfig(**SHAPE, max_position_embeddings=2048, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    config = ours(hf_config)
    assert config.context_length == 4096   # the configured context stretched by the factor, as vLLM reads it
    lengths = torch.tensor([1, 2048, 2049, 3000, 4096])
    ours_by_length = dynamic_ntk_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling, lengths)
    for length, row in zip(lengths, ours_by_length):
        theirs, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, torch.device("cpu"), seq_len=length)
        torch.testing.assert_close(row, theirs, rtol=0, atol=0)


def test_phi3_early_su_name_and_top_level_original_context():
    hf = CONFIGS["longrope"].to_dict()
    raw = {**hf, "architectures": ["Phi3ForCausalLM"], "rope_parameters": None,
           "rope_scaling": {"type": "su", "long_factor": LONG_FACTORS, "short_factor": SHORT_FACTORS}}
    config = model_config_from_hf(raw, None)
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == 4096
    assert config.rope_scaling["factor"] == 32
    with pytest.raises(ValueError, match="long_factor"):
        model_config_from_hf({**raw, "rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTORS}}, None)
