"""Further transformers architectures from tiny configs, beyond the suite (tests/conformance/zoo.py),
as `rannc.check` factories: the scan of 2026-12-06 (README, "Covered architectures"), e.g.

    PYTHONPATH=tests python -m rannc.check conformance.scan:jetmoe conformance.scan:olmoe
    PYTHONHASHSEED=0 PYTHONPATH=tests python -m rannc.check conformance.scan:modernbert \
        --ranks 3 --replicas 2,1 --microbatches 2 --schedule gpipe --batch 7

`NAMES` lists them. Not run by the test suite (the zoo holds those worth their CI time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import transformers as T
from conformance.zoo import (
    _DEC,
    DIFFUSION_IMAGE,
    IMAGE,
    LABELS,
    VOCAB,
    _cfg,
    _diffusers,
    _image_batch,
    _lm_batch,
    _noisy_latents,
    _seq2seq_batch,
    _sequences,
    sd_unet,
)

from rannc.check import Case


def _dec(cfgname: str, modelname: str, base: bool = True, **kw: Any) -> Callable[[], Case]:
    @_sequences
    def make() -> Case:
        args = dict(_DEC) if base else {}
        args.update(kw)
        cfg = _cfg(getattr(T, cfgname), **args)
        return Case(getattr(T, modelname)(cfg), _lm_batch())

    make.__name__ = cfgname
    return make


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
modernbert = _dec(
    "ModernBertConfig",
    "ModernBertForMaskedLM",
    base=False,
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    pad_token_id=0,
    global_attn_every_n_layers=2,
    local_attention=4,
    max_position_embeddings=64,
)
deepseek_v3 = _dec(
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_group=2,
    topk_group=1,
)
deepseek_v2 = _dec(
    "DeepseekV2Config",
    "DeepseekV2ForCausalLM",
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_group=2,
    topk_group=1,
)
qwen3_moe = _dec("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_key_value_heads=2, **MOE)
olmoe = _dec("OlmoeConfig", "OlmoeForCausalLM", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
granite = _dec("GraniteConfig", "GraniteForCausalLM", num_key_value_heads=2)
granitemoe = _dec(
    "GraniteMoeConfig",
    "GraniteMoeForCausalLM",
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
)
cohere = _dec("CohereConfig", "CohereForCausalLM", num_key_value_heads=2)
cohere2 = _dec("Cohere2Config", "Cohere2ForCausalLM", num_key_value_heads=2, sliding_window=4)
glm = _dec("GlmConfig", "GlmForCausalLM", num_key_value_heads=2)
glm4 = _dec("Glm4Config", "Glm4ForCausalLM", num_key_value_heads=2)
phimoe = _dec(
    "PhimoeConfig", "PhimoeForCausalLM", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
)
dbrx = _dec(
    "DbrxConfig",
    "DbrxForCausalLM",
    base=False,
    vocab_size=VOCAB,
    d_model=32,
    n_heads=4,
    n_layers=2,
    max_seq_len=64,
    use_cache=False,
    pad_token_id=0,
    attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
    ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
)
nemotron = _dec("NemotronConfig", "NemotronForCausalLM", num_key_value_heads=2)
helium = _dec("HeliumConfig", "HeliumForCausalLM", num_key_value_heads=2, head_dim=8)
llama4 = _dec(
    "Llama4TextConfig",
    "Llama4ForCausalLM",
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=1,
    intermediate_size_mlp=64,
    head_dim=8,
    interleave_moe_layer_step=2,
    attention_chunk_size=4,
    no_rope_layers=[1, 0],
)
zamba2 = _dec(
    "Zamba2Config",
    "Zamba2ForCausalLM",
    base=False,
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    mamba_d_state=8,
    mamba_headdim=8,
    n_mamba_heads=8,
    mamba_ngroups=1,
    layers_block_type=["mamba", "hybrid"],
    use_cache=False,
    pad_token_id=0,
    use_mem_rope=False,
)
bamba = _dec(
    "BambaConfig",
    "BambaForCausalLM",
    num_key_value_heads=2,
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_d_state=8,
    mamba_n_groups=1,
    attn_layer_indices=[1],
)
falcon_h1 = _dec(
    "FalconH1Config",
    "FalconH1ForCausalLM",
    num_key_value_heads=2,
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_d_state=8,
    mamba_n_groups=1,
    mamba_d_ssm=64,
)
mamba2 = _dec(
    "Mamba2Config",
    "Mamba2ForCausalLM",
    base=False,
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_heads=8,
    head_dim=8,
    state_size=8,
    n_groups=1,
    use_cache=False,
    pad_token_id=0,
    chunk_size=4,
)
smollm3 = _dec("SmolLM3Config", "SmolLM3ForCausalLM", num_key_value_heads=2)
exaone4 = _dec("Exaone4Config", "Exaone4ForCausalLM", num_key_value_heads=2, sliding_window=4)
arcee = _dec("ArceeConfig", "ArceeForCausalLM", num_key_value_heads=2)
dots1 = _dec(
    "Dots1Config",
    "Dots1ForCausalLM",
    num_key_value_heads=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
ernie45 = _dec("Ernie4_5Config", "Ernie4_5ForCausalLM", num_key_value_heads=2)
gpt_oss = _dec(
    "GptOssConfig",
    "GptOssForCausalLM",
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    head_dim=8,
    sliding_window=4,
)
seed_oss = _dec(
    "SeedOssConfig", "SeedOssForCausalLM", num_key_value_heads=2, attention_dropout=0.0, residual_dropout=0.0
)
lfm2 = _dec("Lfm2Config", "Lfm2ForCausalLM", num_key_value_heads=2, full_attn_idxs=[1])
apertus = _dec("ApertusConfig", "ApertusForCausalLM", num_key_value_heads=2)
qwen3_next = _dec(
    "Qwen3NextConfig",
    "Qwen3NextForCausalLM",
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    head_dim=8,
    layer_types=["linear_attention", "full_attention"],
)
minimax = _dec(
    "MiniMaxConfig",
    "MiniMaxForCausalLM",
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    layer_types=["linear_attention", "full_attention"],
    block_size=4,
    head_dim=8,
)
doge = _dec("DogeConfig", "DogeForCausalLM", num_key_value_heads=2)
olmo = _dec("OlmoConfig", "OlmoForCausalLM", num_key_value_heads=2)
olmo3 = _dec("Olmo3Config", "Olmo3ForCausalLM", num_key_value_heads=2, sliding_window=4)
persimmon = _dec("PersimmonConfig", "PersimmonForCausalLM")
xglm = _dec(
    "XGLMConfig",
    "XGLMForCausalLM",
    base=False,
    vocab_size=VOCAB,
    d_model=32,
    ffn_dim=64,
    num_layers=2,
    attention_heads=4,
    max_position_embeddings=64,
    use_cache=False,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    layerdrop=0.0,
    pad_token_id=0,
)
biogpt = _dec(
    "BioGptConfig",
    "BioGptForCausalLM",
    base=False,
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    use_cache=False,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    layerdrop=0.0,
    pad_token_id=0,
)
gpt_neo = _dec(
    "GPTNeoConfig",
    "GPTNeoForCausalLM",
    base=False,
    vocab_size=VOCAB,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    attention_types=[[["global", "local"], 1]],
    window_size=4,
    max_position_embeddings=64,
    use_cache=False,
    embed_dropout=0.0,
    attention_dropout=0.0,
    resid_dropout=0.0,
    pad_token_id=0,
)
jetmoe = _dec(
    "JetMoeConfig",
    "JetMoeForCausalLM",
    base=False,
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_key_value_heads=2,
    kv_channels=8,
    intermediate_size=64,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    use_cache=False,
    pad_token_id=0,
)
granitemoehybrid = _dec(
    "GraniteMoeHybridConfig",
    "GraniteMoeHybridForCausalLM",
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_d_state=8,
    mamba_n_groups=1,
    layer_types=["mamba", "attention"],
)
hunyuan = _dec("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", num_key_value_heads=2, head_dim=8)
bitnet = _dec("BitNetConfig", "BitNetForCausalLM", num_key_value_heads=2)
diffllama = _dec("DiffLlamaConfig", "DiffLlamaForCausalLM", num_key_value_heads=2)
glm4_moe = _dec(
    "Glm4MoeConfig",
    "Glm4MoeForCausalLM",
    num_key_value_heads=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
vaultgemma = _dec(
    "VaultGemmaConfig", "VaultGemmaForCausalLM", num_key_value_heads=2, head_dim=8, sliding_window=4
)
ministral = _dec(
    "MinistralConfig",
    "MinistralForCausalLM",
    num_key_value_heads=2,
    sliding_window=4,
    head_dim=8,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
flexolmo = _dec(
    "FlexOlmoConfig", "FlexOlmoForCausalLM", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2
)
lfm2_moe = _dec(
    "Lfm2MoeConfig",
    "Lfm2MoeForCausalLM",
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    num_dense_layers=1,
    layer_types=["conv", "full_attention"],
)
nanochat = _dec("NanoChatConfig", "NanoChatForCausalLM", num_key_value_heads=2)
eurobert = _dec("EuroBertConfig", "EuroBertForMaskedLM", num_key_value_heads=2)
modernbert_dec = _dec(
    "ModernBertDecoderConfig",
    "ModernBertDecoderForCausalLM",
    base=False,
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    pad_token_id=0,
    local_attention=4,
    max_position_embeddings=64,
    global_attn_every_n_layers=2,
    use_cache=False,
)
gemma3n = _dec(
    "Gemma3nTextConfig",
    "Gemma3nForCausalLM",
    num_key_value_heads=2,
    head_dim=8,
    sliding_window=4,
    laurel_rank=8,
    altup_num_inputs=2,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB,
    activation_sparsity_pattern=[0.0, 0.0],
    num_kv_shared_layers=0,
    layer_types=["sliding_attention", "full_attention"],
)

_ENC = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    max_position_embeddings=64,
)


def _enc(cfgname: str, modelname: str, labels: str = "tokens", base: bool = True, **kw: Any
         ) -> Callable[[], Case]:
    @_sequences
    def make() -> Case:
        args = dict(_ENC) if base else {}
        args.update(kw)
        cfg = _cfg(getattr(T, cfgname), **args)
        return Case(getattr(T, modelname)(cfg), _lm_batch(labels=labels))

    make.__name__ = cfgname
    return make


roformer = _enc("RoFormerConfig", "RoFormerForMaskedLM")
nystromformer = _enc(
    "NystromformerConfig",
    "NystromformerForMaskedLM",
    num_landmarks=4,
    segment_means_seq_len=12,
    conv_kernel_size=3,
)
bigbird = _enc("BigBirdConfig", "BigBirdForMaskedLM", attention_type="original_full")
fnet = _enc(
    "FNetConfig",
    "FNetForMaskedLM",
    base=False,
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=64,
    hidden_dropout_prob=0.0,
    max_position_embeddings=64,
)
convbert = _enc("ConvBertConfig", "ConvBertForMaskedLM", embedding_size=32, head_ratio=2, conv_kernel_size=3)
data2vec_text = _enc("Data2VecTextConfig", "Data2VecTextForMaskedLM", pad_token_id=1)
megatron_bert = _enc("MegatronBertConfig", "MegatronBertForMaskedLM")
ernie = _enc("ErnieConfig", "ErnieForMaskedLM")
xmod = _enc("XmodConfig", "XmodForMaskedLM", pad_token_id=1, languages=["en_XX"], default_language="en_XX")
layoutlm = _enc("LayoutLMConfig", "LayoutLMForMaskedLM")
rembert = _enc("RemBertConfig", "RemBertForMaskedLM", input_embedding_size=16, output_embedding_size=16)
mra = _enc("MraConfig", "MraForMaskedLM", block_per_row=2, approx_mode="full")
yoso = _enc("YosoConfig", "YosoForMaskedLM", use_expectation=True)
luke = _enc("LukeConfig", "LukeForMaskedLM", entity_vocab_size=16, entity_emb_size=16)
splinter = _enc("SplinterConfig", "SplinterForQuestionAnswering", labels="none")

xlm = _enc(
    "XLMConfig",
    "XLMWithLMHeadModel",
    base=False,
    vocab_size=VOCAB,
    emb_dim=32,
    n_layers=2,
    n_heads=4,
    dropout=0.0,
    attention_dropout=0.0,
    max_position_embeddings=64,
    pad_index=0,
)
ctrl = _enc(
    "CTRLConfig",
    "CTRLLMHeadModel",
    base=False,
    vocab_size=VOCAB,
    n_embd=32,
    n_layer=2,
    n_head=4,
    dff=64,
    n_positions=64,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    use_cache=False,
    pad_token_id=0,
)


def _s2s(cfgname: str, modelname: str, **kw: Any) -> Callable[[], Case]:
    @_sequences
    def make() -> Case:
        cfg = _cfg(getattr(T, cfgname), **kw)
        return Case(getattr(T, modelname)(cfg), _seq2seq_batch())

    make.__name__ = cfgname
    return make


_T5 = dict(
    vocab_size=VOCAB,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    dropout_rate=0.0,
    use_cache=False,
    decoder_start_token_id=0,
    pad_token_id=0,
)
umt5 = _s2s("UMT5Config", "UMT5ForConditionalGeneration", **_T5)
mt5 = _s2s("MT5Config", "MT5ForConditionalGeneration", **_T5)
longt5 = _s2s(
    "LongT5Config", "LongT5ForConditionalGeneration", **_T5, local_radius=2, encoder_attention_type="local"
)
_BART = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    encoder_layerdrop=0.0,
    decoder_layerdrop=0.0,
    use_cache=False,
    pad_token_id=0,
    decoder_start_token_id=2,
    eos_token_id=1,
    bos_token_id=0,
)
led = _s2s(
    "LEDConfig",
    "LEDForConditionalGeneration",
    **_BART,
    attention_window=4,
    max_encoder_position_embeddings=64,
    max_decoder_position_embeddings=64,
)
mvp = _s2s("MvpConfig", "MvpForConditionalGeneration", **_BART)
plbart = _s2s("PLBartConfig", "PLBartForConditionalGeneration", **_BART)
blenderbot = _s2s("BlenderbotConfig", "BlenderbotForConditionalGeneration", **_BART)
marian = _s2s("MarianConfig", "MarianMTModel", **_BART)
nllb_moe = _s2s(
    "NllbMoeConfig",
    "NllbMoeForConditionalGeneration",
    **_BART,
    num_experts=4,
    expert_capacity=8,
    encoder_sparse_step=1,
    decoder_sparse_step=1,
)


def _img(cfgname: str, modelname: str, **kw: Any) -> Callable[[], Case]:
    def make() -> Case:
        cfg = _cfg(getattr(T, cfgname), num_labels=LABELS, **kw)
        return Case(getattr(T, modelname)(cfg), _image_batch())

    make.__name__ = cfgname
    return make


convnextv2 = _img(
    "ConvNextV2Config", "ConvNextV2ForImageClassification", hidden_sizes=[16, 32], depths=[1, 1], num_stages=2
)
pvt_v2 = _img(
    "PvtV2Config",
    "PvtV2ForImageClassification",
    image_size=IMAGE,
    hidden_sizes=[16, 32],
    depths=[1, 1],
    num_encoder_blocks=2,
    sr_ratios=[2, 1],
    num_attention_heads=[1, 2],
    patch_sizes=[7, 3],
    strides=[4, 2],
    mlp_ratios=[2, 2],
)
hiera = _img(
    "HieraConfig",
    "HieraForImageClassification",
    image_size=[IMAGE, IMAGE],
    patch_size=[3, 3],
    patch_stride=[2, 2],
    patch_padding=[1, 1],
    embed_dim=16,
    depths=[1, 1],
    num_heads=[1, 2],
    query_stride=[2, 2],
    masked_unit_size=[4, 4],
    drop_path_rate=0.0,
    num_query_pool=1,
)
focalnet = _img(
    "FocalNetConfig",
    "FocalNetForImageClassification",
    image_size=IMAGE,
    patch_size=4,
    embed_dim=16,
    depths=[1, 1],
    focal_levels=[2, 2],
    focal_windows=[3, 3],
    drop_path_rate=0.0,
    hidden_dropout_prob=0.0,
)
poolformer = _img(
    "PoolFormerConfig",
    "PoolFormerForImageClassification",
    hidden_sizes=[16, 32, 32, 32],
    depths=[1, 1, 1, 1],
    drop_path_rate=0.0,
)
cvt = _img(
    "CvtConfig",
    "CvtForImageClassification",
    embed_dim=[16, 32, 32],
    depth=[1, 2, 3],  # (transformers indexes each stage's drop-path rates by the stage)
    num_heads=[1, 2, 2],
    drop_path_rate=[0.0, 0.0, 0.0],
)


def _aud(cfgname: str, modelname: str, **kw: Any) -> Callable[[], Case]:
    def make() -> Case:
        import torch

        cfg = _cfg(
            getattr(T, cfgname),
            num_labels=LABELS,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            conv_dim=(16, 16),
            conv_stride=(5, 4),
            conv_kernel=(10, 4),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            feat_proj_dropout=0.0,
            layerdrop=0.0,
            mask_time_prob=0.0,
            **kw,
        )

        def batch(n):
            return {"input_values": torch.randn(n, 400), "labels": torch.randint(0, LABELS, (n,))}

        return Case(getattr(T, modelname)(cfg), batch)

    make.__name__ = cfgname
    return make


hubert = _aud("HubertConfig", "HubertForSequenceClassification")
wavlm = _aud("WavLMConfig", "WavLMForSequenceClassification", num_buckets=32, max_bucket_distance=64)
sew = _aud("SEWConfig", "SEWForSequenceClassification", squeeze_factor=2)
unispeech = _aud("UniSpeechConfig", "UniSpeechForSequenceClassification")
data2vec_audio = _aud("Data2VecAudioConfig", "Data2VecAudioForSequenceClassification", conv_pos_kernel_size=5)


def lilt() -> Case:
    import torch

    # (its layout embedding is 6 parts of hidden_size // 6: a width divisible by 6)
    cfg = _cfg(T.LiltConfig, **{**_ENC, "hidden_size": 48, "intermediate_size": 96},
               num_labels=LABELS, channel_shrink_ratio=2, pad_token_id=1)
    base = _lm_batch(labels="class")

    def batch(n):
        b = base(n)
        xy = torch.randint(0, 500, (n, b["input_ids"].shape[1], 2))
        b["bbox"] = torch.cat([xy, xy + torch.randint(1, 400, xy.shape)], -1)
        return b

    return Case(T.LiltForSequenceClassification(cfg), batch)


# -- diffusers (the scan of 2026-12-08; the suite holds sd_unet, sd_vae and dit) ------------------
def unet2d() -> Case:
    """UNet2DModel, unconditional, with attention blocks."""
    import torch

    torch.manual_seed(0)
    return Case(_diffusers().UNet2DModel(
        sample_size=DIFFUSION_IMAGE, in_channels=3, out_channels=3, block_out_channels=(16, 32),
        layers_per_block=1, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8, attention_head_dim=8),
        _noisy_latents(3))


def sdxl_unet() -> Case:
    """UNet2DConditionModel as SDXL's: text-time added embeddings (a nested dict input), linear
    projections, two transformer layers in a block."""
    import torch

    torch.manual_seed(0)
    model = _diffusers().UNet2DConditionModel(
        sample_size=DIFFUSION_IMAGE, in_channels=4, out_channels=4, block_out_channels=(16, 32),
        layers_per_block=1, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
        cross_attention_dim=24, attention_head_dim=8, addition_embed_type="text_time",
        addition_time_embed_dim=8, projection_class_embeddings_input_dim=12 + 6 * 8,
        transformer_layers_per_block=(1, 2), use_linear_projection=True)
    base = _noisy_latents(4, (5, 24))

    def batch(n):
        b = base(n)
        b["added_cond_kwargs"] = {"text_embeds": torch.randn(n, 12), "time_ids": torch.randn(n, 6)}
        return b
    return Case(model, batch)


def controlnet() -> Case:
    """ControlNetModel: the UNet's encoder and a conditioning image's embedding, zero-initialised
    output convolutions (its outputs are zeros at first)."""
    import torch

    torch.manual_seed(0)
    model = _diffusers().ControlNetModel(
        in_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), norm_num_groups=8,
        cross_attention_dim=24, attention_head_dim=8, conditioning_embedding_out_channels=(8, 8))
    base = _noisy_latents(4, (5, 24))

    def batch(n):
        b = base(n)
        b["controlnet_cond"] = torch.randn(n, 3, 2 * DIFFUSION_IMAGE, 2 * DIFFUSION_IMAGE)
        return b
    return Case(model, batch)


def sd3() -> Case:
    """SD3Transformer2DModel (MMDiT: joint attention over image and text tokens)."""
    import torch

    torch.manual_seed(0)
    model = _diffusers().SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=16,
        pooled_projection_dim=12, out_channels=4, pos_embed_max_size=16)

    def batch(n):
        return {"hidden_states": torch.randn(n, 4, 8, 8), "timestep": torch.randint(0, 1000, (n,)),
                "encoder_hidden_states": torch.randn(n, 5, 24), "pooled_projections": torch.randn(n, 12)}
    return Case(model, batch)


def flux() -> Case:
    """FluxTransformer2DModel: double- and single-stream blocks, rotary positions from ids."""
    import torch

    torch.manual_seed(0)
    model = _diffusers().FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12,
        guidance_embeds=False, axes_dims_rope=(2, 2, 4))

    def batch(n):
        return {"hidden_states": torch.randn(n, 16, 16), "timestep": torch.rand(n),
                "encoder_hidden_states": torch.randn(n, 5, 24), "pooled_projections": torch.randn(n, 12),
                "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(5, 3)}
    return Case(model, batch)


def unet_lora() -> Case:
    """The suite's sd_unet frozen, with peft LoRA adapters on its attention (`add_adapter`), as
    LoRA fine-tuning of Stable Diffusion trains it."""
    from peft import LoraConfig

    case = sd_unet()
    case.model.requires_grad_(False)
    case.model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                      target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    return case


NAMES = sorted(
    k
    for k, v in dict(globals()).items()
    if callable(v) and getattr(v, "__module__", "") == __name__ and not k.startswith("_") and k[0].islower()
)
