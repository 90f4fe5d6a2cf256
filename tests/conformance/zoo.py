"""Real architectures from tiny configs, with random weights (nothing downloaded), as factories
for `rannc.check` (`python -m rannc.check conformance.zoo:llama --ranks 2 ...`).

Every config: hidden 32-64, 2 layers, vocabulary 64, sequences of 12, images 32x32, dropout 0
(so the reference and the wrapped run need no common RNG), no KV cache. Batches carry the
model's natural full labels (no -100), so the row-weighted mean rannc gives scalar outputs
equals the global mean; `llama_masked` masks a different number of labels in each row (-100)
and passes Hugging Face's `num_items_in_batch`, the path that is exact for such labels.

A factory whose library is missing (torchvision, timm, diffusers) raises `Unavailable`; the suite skips it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rannc.check import Case

logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = 64
SEQ = 12
IMAGE = 32
LABELS = 5


class Unavailable(Exception):
    """The library a factory needs is not installed or does not load (the suite skips it)."""


def _cfg(cls: Any, **kw: Any) -> Any:
    """A config with the eager attention path: the one every architecture has, and the one
    whose math the reference and each stage run alike."""
    cfg = cls(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _lm_batch(vocab: int = VOCAB, seq: int = SEQ, mask: bool = True,
              labels: str = "tokens") -> Callable[[int], dict[str, torch.Tensor]]:
    """Token ids, a right-padded attention mask (every row keeps at least half its tokens), and
    full labels: the tokens themselves (causal LM: the model shifts them), or one class a row."""
    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(2, vocab, (n, seq))
        out = {"input_ids": ids}
        if mask:
            lengths = torch.randint(seq // 2, seq + 1, (n,))
            out["attention_mask"] = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        if labels == "tokens":
            out["labels"] = ids.clone()
        elif labels == "class":
            out["labels"] = torch.randint(0, LABELS, (n,))
        elif labels == "token_class":
            out["labels"] = torch.randint(0, LABELS, (n, seq))
        return out
    return batch


def _sequences(make: Callable[[], Case]) -> Callable[[], Case]:
    """`make`'s case with `Case.reshaped`: its batches with sequences 4 tokens shorter (every
    tensor's second dimension as long as `input_ids`'; a decoder's labels 2), which the second
    call of the last checked training step (an accumulation of two) takes, as dynamic padding
    gives a new length at every step: the model is captured again and that graph placed on the
    deployed stages (`rannc.derive`).
    (Found so: BART's and ALBERT's tied weights summed over fewer ranks than hold them.)"""
    @functools.wraps(make)
    def made() -> Case:
        case = make()
        full = case.batch

        def shorter(n: int) -> dict[str, torch.Tensor]:
            batch = full(n)
            seq = batch["input_ids"].shape[1]
            out = {k: v[:, :seq - 4].contiguous()
                   if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == seq else v
                   for k, v in batch.items()}
            labels = batch.get("labels")
            if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and labels.shape[1] != seq:
                out["labels"] = labels[:, :-2].contiguous()  # a decoder's: 2 tokens shorter
            return out
        case.reshaped = shorter
        return case
    return made


def _image_batch(channels: int = 3, size: int = IMAGE, key: str = "pixel_values",
                 ) -> Callable[[int], dict[str, torch.Tensor]]:
    def batch(n: int) -> dict[str, torch.Tensor]:
        return {key: torch.randn(n, channels, size, size), "labels": torch.randint(0, LABELS, (n,))}
    return batch


_DEC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, use_cache=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=1)


# -- decoder-only -------------------------------------------------------------------------------
@_sequences
def llama() -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    return Case(LlamaForCausalLM(_cfg(LlamaConfig, **_DEC, num_key_value_heads=2)), _lm_batch())


def llama_masked() -> Case:
    """Llama with labels masked (-100) at random, a different count in each row, as a padding
    collator or a prompt mask gives, and `num_items_in_batch` (the global batch's count of
    labelled tokens after the shift, as Trainer passes it): the loss is the global token mean
    only so (each piece's own mean weighted by rows is not)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = _lm_batch()

    def batch(n: int) -> dict[str, torch.Tensor]:
        out = tokens(n)
        labels = out["labels"]
        labels[torch.rand(labels.shape) < 0.4] = -100
        out["num_items_in_batch"] = (labels[:, 1:] != -100).sum()
        return out
    return Case(LlamaForCausalLM(_cfg(LlamaConfig, **_DEC, num_key_value_heads=2)), batch)


@_sequences
def mistral() -> Case:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = _cfg(MistralConfig, **_DEC, num_key_value_heads=2, sliding_window=None)
    return Case(MistralForCausalLM(cfg), _lm_batch())


@_sequences
def qwen2() -> Case:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Case(Qwen2ForCausalLM(_cfg(Qwen2Config, **_DEC, num_key_value_heads=2)), _lm_batch())


@_sequences
def qwen3() -> Case:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = _cfg(Qwen3Config, **_DEC, num_key_value_heads=2, head_dim=8)
    return Case(Qwen3ForCausalLM(cfg), _lm_batch())


@_sequences
def gemma() -> Case:
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = _cfg(GemmaConfig, **_DEC, num_key_value_heads=1, head_dim=8)
    return Case(GemmaForCausalLM(cfg), _lm_batch())


@_sequences
def phi() -> Case:
    from transformers import PhiConfig, PhiForCausalLM

    cfg = _cfg(PhiConfig, **_DEC, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
               partial_rotary_factor=0.5)
    return Case(PhiForCausalLM(cfg), _lm_batch())


@_sequences
def mixtral() -> Case:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = _cfg(MixtralConfig, **_DEC, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2, sliding_window=None, router_jitter_noise=0.0)
    return Case(MixtralForCausalLM(cfg), _lm_batch())


@_sequences
def phimoe() -> Case:
    """Its router's gradient is its own autograd.Function's (sparsemixer's estimate), which a
    capture kept only as the derivative of its forward before (rannc.graph.functions). Its
    training draws random numbers (Gumbel sampling of the experts): one process only, where
    rannc draws what the model draws."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    cfg = _cfg(PhimoeConfig, **_DEC, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    return Case(PhimoeForCausalLM(cfg), _lm_batch())


@_sequences
def gpt2() -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    # (use_cache left at its default, True, here and in T5: rannc passes use_cache=False,
    # rannc.calls.without_cache)
    cfg = _cfg(GPT2Config, vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1)
    return Case(GPT2LMHeadModel(cfg), _lm_batch())


@_sequences
def gpt_neox() -> Case:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = _cfg(GPTNeoXConfig, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
               rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)
    return Case(GPTNeoXForCausalLM(cfg), _lm_batch())


@_sequences
def opt() -> Case:
    from transformers import OPTConfig, OPTForCausalLM

    cfg = _cfg(OPTConfig, vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
               num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64,
               dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
               use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    return Case(OPTForCausalLM(cfg), _lm_batch())


@_sequences
def falcon() -> Case:
    from transformers import FalconConfig, FalconForCausalLM

    cfg = _cfg(FalconConfig, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False,
               new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False)
    return Case(FalconForCausalLM(cfg), _lm_batch())


@_sequences
def bloom() -> Case:
    from transformers import BloomConfig, BloomForCausalLM

    cfg = _cfg(BloomConfig, vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
               hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)
    return Case(BloomForCausalLM(cfg), _lm_batch())


@_sequences
def gptj() -> Case:
    from transformers import GPTJConfig, GPTJForCausalLM

    cfg = _cfg(GPTJConfig, vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
               rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
               bos_token_id=1, eos_token_id=1)
    return Case(GPTJForCausalLM(cfg), _lm_batch())


# -- encoders -----------------------------------------------------------------------------------
_ENC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)


@_sequences
def bert() -> Case:
    from transformers import BertConfig, BertForMaskedLM

    return Case(BertForMaskedLM(_cfg(BertConfig, **_ENC)), _lm_batch())


@_sequences
def roberta() -> Case:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    cfg = _cfg(RobertaConfig, **_ENC, num_labels=LABELS, pad_token_id=1)
    return Case(RobertaForSequenceClassification(cfg), _lm_batch(labels="class"))


@_sequences
def distilbert() -> Case:
    from transformers import DistilBertConfig, DistilBertForTokenClassification

    cfg = _cfg(DistilBertConfig, vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
               max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
               num_labels=LABELS)
    return Case(DistilBertForTokenClassification(cfg), _lm_batch(labels="token_class"))


@_sequences
def albert() -> Case:
    from transformers import AlbertConfig, AlbertForPreTraining

    cfg = _cfg(AlbertConfig, **_ENC, embedding_size=16, classifier_dropout_prob=0.0)
    base = _lm_batch()

    def batch(n: int) -> dict[str, torch.Tensor]:
        return {**base(n), "sentence_order_label": torch.randint(0, 2, (n,))}
    return Case(AlbertForPreTraining(cfg), batch)


@_sequences
def yoso() -> Case:
    """Attention by the expectation of LSH collisions: its own autograd.Function, whose
    backward is its own closed form (before rannc.graph.functions, replaced by autograd of the
    forward's ops: gradients off by up to 46x)."""
    from transformers import YosoConfig, YosoForMaskedLM

    return Case(YosoForMaskedLM(_cfg(YosoConfig, **_ENC, use_expectation=True)), _lm_batch())


@_sequences
def electra() -> Case:
    from transformers import ElectraConfig, ElectraForPreTraining

    cfg = _cfg(ElectraConfig, **_ENC, embedding_size=16)
    # No padding: ELECTRA's loss is a mean over the unpadded tokens, a data-dependent count
    # (exact under rannc only through num_items_in_batch; see the module's TODO).
    base = _lm_batch(labels="", mask=False)

    def batch(n: int) -> dict[str, torch.Tensor]:
        return {**base(n), "labels": torch.randint(0, 2, (n, SEQ)).float()}
    return Case(ElectraForPreTraining(cfg), batch)


@_sequences
def deberta_v2() -> Case:
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    cfg = _cfg(DebertaV2Config, **_ENC, num_labels=LABELS, relative_attention=True,
               position_buckets=8, max_relative_positions=16, pooler_dropout=0.0,
               pos_att_type=["p2c", "c2p"], problem_type="single_label_classification")
    return Case(DebertaV2ForSequenceClassification(cfg), _lm_batch(labels="class"))


# -- encoder-decoders, given only labels (the decoder inputs are the labels shifted right) -------
@_sequences
def t5() -> Case:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = _cfg(T5Config, vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
               num_heads=4, dropout_rate=0.0, relative_attention_num_buckets=8,
               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return Case(T5ForConditionalGeneration(cfg), _seq2seq_batch())


@_sequences
def bart() -> Case:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = _cfg(BartConfig, vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
               decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
               attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
               decoder_layerdrop=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
               decoder_start_token_id=2, use_cache=False)
    return Case(BartForConditionalGeneration(cfg), _seq2seq_batch())


def _seq2seq_batch() -> Callable[[int], dict[str, torch.Tensor]]:
    base = _lm_batch(labels="")

    def batch(n: int) -> dict[str, torch.Tensor]:
        return {**base(n), "labels": torch.randint(3, VOCAB, (n, 8))}
    return batch


@_sequences
def bert2gpt2() -> Case:
    """A warm-started sequence-to-sequence model: transformers' EncoderDecoderModel, a BERT
    encoder and a GPT-2 decoder with cross-attention, its config a config of configs whose
    decoder's asks for a key/value cache (rannc calls it without one)."""
    from transformers import BertConfig, EncoderDecoderConfig, EncoderDecoderModel, GPT2Config

    enc = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     max_position_embeddings=32)
    dec = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, add_cross_attention=True,
                     is_decoder=True)
    cfg = _cfg(EncoderDecoderConfig.from_encoder_decoder_configs, encoder_config=enc,
               decoder_config=dec)
    cfg.decoder_start_token_id, cfg.pad_token_id = 1, 0
    return Case(EncoderDecoderModel(cfg), _seq2seq_batch())


def whisper() -> Case:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = _cfg(WhisperConfig, vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2,
               decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
               max_target_positions=32, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
               pad_token_id=0, bos_token_id=1, eos_token_id=1, decoder_start_token_id=1,
               use_cache=False, suppress_tokens=None, begin_suppress_tokens=None)

    def batch(n: int, labels: int = 6) -> dict[str, torch.Tensor]:
        return {"input_features": torch.randn(n, 8, 32),
                "labels": torch.randint(3, VOCAB, (n, labels))}
    # Whisper's encoder takes exactly 2 * max_source_positions frames: the decoder's labels
    # are what dynamic padding shortens (`Case.reshaped`)
    return Case(WhisperForConditionalGeneration(cfg), batch,
                reshaped=lambda n: batch(n, labels=4))


# -- vision (Hugging Face) ------------------------------------------------------------------------
def vit() -> Case:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = _cfg(ViTConfig, image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, num_labels=LABELS)
    return Case(ViTForImageClassification(cfg), _image_batch())


def swin() -> Case:
    from transformers import SwinConfig, SwinForImageClassification

    cfg = _cfg(SwinConfig, image_size=IMAGE, patch_size=4, embed_dim=16, depths=[2, 1],
               num_heads=[2, 4], window_size=4, mlp_ratio=2.0, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=LABELS)
    return Case(SwinForImageClassification(cfg), _image_batch())


def convnext() -> Case:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = _cfg(ConvNextConfig, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], image_size=IMAGE,
               drop_path_rate=0.0, num_labels=LABELS)
    return Case(ConvNextForImageClassification(cfg), _image_batch())


def resnet() -> Case:
    """BatchNorm."""
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = _cfg(ResNetConfig, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
               layer_type="basic", num_labels=LABELS)
    return Case(ResNetForImageClassification(cfg), _image_batch())


def mobilenet_v2() -> Case:
    """BatchNorm."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    cfg = _cfg(MobileNetV2Config, image_size=IMAGE, depth_multiplier=0.25, min_depth=4,
               classifier_dropout_prob=0.0, num_labels=LABELS)
    return Case(MobileNetV2ForImageClassification(cfg), _image_batch())


def efficientnet() -> Case:
    """BatchNorm, squeeze-and-excitation."""
    from transformers import EfficientNetConfig, EfficientNetForImageClassification

    # hidden_dim: the top convolution's width, round_filters(1280) = 128 at width 0.1
    cfg = _cfg(EfficientNetConfig, image_size=IMAGE, width_coefficient=0.1, depth_coefficient=0.2,
               hidden_dim=128, dropout_rate=0.0, drop_connect_rate=0.0, num_labels=LABELS)
    return Case(EfficientNetForImageClassification(cfg), _image_batch())


def regnet() -> Case:
    """BatchNorm, grouped convolutions."""
    from transformers import RegNetConfig, RegNetForImageClassification

    cfg = _cfg(RegNetConfig, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
               groups_width=4, num_labels=LABELS)
    return Case(RegNetForImageClassification(cfg), _image_batch())


# -- torchvision and timm (optional: skipped when the library does not load) ----------------------
def _torchvision_models() -> Any:
    try:
        import torchvision.models as tvm
    except Exception as e:  # noqa: BLE001 - any import failure (e.g. its ops library) means skip
        raise Unavailable(f"torchvision does not load: {type(e).__name__}: {e}") from e
    return tvm


def _classify(model: nn.Module) -> Case:
    def loss(out: torch.Tensor, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(out, inputs[1])

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, IMAGE, IMAGE), torch.randint(0, LABELS, (n,))

    class WithLabels(nn.Module):  # the labels ride along as an input the model ignores
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    return Case(WithLabels(), batch, loss)


def tv_resnet18() -> Case:
    """torchvision ResNet-18 (BatchNorm), width as published, 5 classes."""
    return _classify(_torchvision_models().resnet18(num_classes=LABELS))


def tv_mobilenet_v3() -> Case:
    """torchvision MobileNetV3-small (BatchNorm, hard-swish, squeeze-and-excitation)."""
    return _classify(_torchvision_models().mobilenet_v3_small(num_classes=LABELS, dropout=0.0))


def timm_vit() -> Case:
    try:
        import timm
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"timm does not load: {type(e).__name__}: {e}") from e
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMAGE, patch_size=8,
                              embed_dim=32, depth=2, num_heads=4, num_classes=LABELS)
    return _classify(model)


# -- more architectures: softcapping and sliding windows, MoE with a shared expert, state-space
# scans, relative and two-stream attention, pooling encoders, speech convolutions, and a batch
# output whose rows are not its first dimension (XLNet's memories, sequence x batch x hidden)
@_sequences
def gemma2() -> Case:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = _cfg(Gemma2Config, **_DEC, num_key_value_heads=2, head_dim=8, sliding_window=4,
               final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    return Case(Gemma2ForCausalLM(cfg), _lm_batch())


@_sequences
def gemma3() -> Case:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = _cfg(Gemma3TextConfig, **_DEC, num_key_value_heads=2, head_dim=8, sliding_window=4)
    return Case(Gemma3ForCausalLM(cfg), _lm_batch())


@_sequences
def phi3() -> Case:
    from transformers import Phi3Config, Phi3ForCausalLM

    return Case(Phi3ForCausalLM(_cfg(Phi3Config, **_DEC, num_key_value_heads=2)), _lm_batch())


@_sequences
def olmo2() -> Case:
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Case(Olmo2ForCausalLM(_cfg(Olmo2Config, **_DEC, num_key_value_heads=2)), _lm_batch())


@_sequences
def starcoder2() -> Case:
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    cfg = _cfg(Starcoder2Config, **_DEC, num_key_value_heads=2, sliding_window=None,
               residual_dropout=0.0, embedding_dropout=0.0)
    return Case(Starcoder2ForCausalLM(cfg), _lm_batch())


@_sequences
def stablelm() -> Case:
    from transformers import StableLmConfig, StableLmForCausalLM

    return Case(StableLmForCausalLM(_cfg(StableLmConfig, **_DEC, num_key_value_heads=2)),
                _lm_batch())


@_sequences
def qwen2_moe() -> Case:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = _cfg(Qwen2MoeConfig, **_DEC, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return Case(Qwen2MoeForCausalLM(cfg), _lm_batch())


@_sequences
def gpt_bigcode() -> Case:
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    cfg = _cfg(GPTBigCodeConfig, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return Case(GPTBigCodeForCausalLM(cfg), _lm_batch())


@_sequences
def codegen() -> Case:
    from transformers import CodeGenConfig, CodeGenForCausalLM

    cfg = _cfg(CodeGenConfig, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
               rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return Case(CodeGenForCausalLM(cfg), _lm_batch())


@_sequences
def mamba() -> Case:
    """A state-space model: its selective scan, no attention (and no attention mask)."""
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2,
                      use_cache=False)
    return Case(MambaForCausalLM(cfg), _lm_batch(mask=False))


@_sequences
def mamba2() -> Case:
    """Mamba-2: the chunked state-space duality scan (its torch path), gated RMSNorm."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = _cfg(Mamba2Config, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8,
               head_dim=8, state_size=8, n_groups=1, chunk_size=4, use_cache=False, pad_token_id=0)
    return Case(Mamba2ForCausalLM(cfg), _lm_batch())


@_sequences
def deepseek_v3() -> Case:
    """Multi-head latent attention (low-rank queries and keys, decoupled rotary part), a dense
    first layer, then routed experts by group-limited top-k with a shared expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = _cfg(DeepseekV3Config, **_DEC, num_key_value_heads=4, n_routed_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
               first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
               qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1)
    return Case(DeepseekV3ForCausalLM(cfg), _lm_batch())


@_sequences
def gpt_oss() -> Case:
    """Attention sinks, alternating sliding-window layers, experts with clamped SwiGLU."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = _cfg(GptOssConfig, **_DEC, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2, head_dim=8, sliding_window=4)
    return Case(GptOssForCausalLM(cfg), _lm_batch())


@_sequences
def jetmoe() -> Case:
    """Mixtures of experts in both the attention and the feed-forward, each expert's token
    count read with .tolist() to split the sorted tokens: sizes from tensor values, which
    were taken for the batch size (a stage cut after the router split by the row count)."""
    from transformers import JetMoeConfig, JetMoeForCausalLM

    cfg = _cfg(JetMoeConfig, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
               num_key_value_heads=2, kv_channels=8, intermediate_size=64, num_local_experts=4,
               num_experts_per_tok=2, max_position_embeddings=64, use_cache=False, pad_token_id=0)
    return Case(JetMoeForCausalLM(cfg), _lm_batch())


@_sequences
def modernbert() -> Case:
    """Alternating global and local attention, rotary embeddings per attention type (built by
    iterating a set of strings: the same PYTHONHASHSEED on every rank, see the README)."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    cfg = _cfg(ModernBertConfig, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, pad_token_id=0,
               global_attn_every_n_layers=2, local_attention=4, max_position_embeddings=64)
    return Case(ModernBertForMaskedLM(cfg), _lm_batch())


@_sequences
def xlnet() -> Case:
    """Two-stream relative attention; in eval() it returns its memories, sequence x batch x
    hidden (each rank gets its rows of dimension 1)."""
    from transformers import XLNetConfig, XLNetForSequenceClassification

    cfg = _cfg(XLNetConfig, vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, d_inner=64,
               dropout=0.0, summary_last_dropout=0.0, num_labels=LABELS, use_mems_train=False)
    return Case(XLNetForSequenceClassification(cfg), _lm_batch(labels="class"))


@_sequences
def mpnet() -> Case:
    from transformers import MPNetConfig, MPNetForMaskedLM

    return Case(MPNetForMaskedLM(_cfg(MPNetConfig, **_ENC)), _lm_batch())


@_sequences
def funnel() -> Case:
    """Pools the sequence between blocks."""
    from transformers import FunnelConfig, FunnelForSequenceClassification

    cfg = _cfg(FunnelConfig, vocab_size=VOCAB, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8,
               d_inner=64, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
               num_labels=LABELS)
    return Case(FunnelForSequenceClassification(cfg), _lm_batch(labels="class"))


@_sequences
def pegasus() -> Case:
    from transformers import PegasusConfig, PegasusForConditionalGeneration

    cfg = _cfg(PegasusConfig, vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
               decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
               use_cache=False)
    return Case(PegasusForConditionalGeneration(cfg), _seq2seq_batch())


@_sequences
def m2m100() -> Case:
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    cfg = _cfg(M2M100Config, vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
               decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
               pad_token_id=0, eos_token_id=1, decoder_start_token_id=1, use_cache=False)
    return Case(M2M100ForConditionalGeneration(cfg), _seq2seq_batch())


def wav2vec2() -> Case:
    """A convolutional feature encoder over raw audio, then a transformer."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    cfg = _cfg(Wav2Vec2Config, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, conv_dim=(16, 16), conv_stride=(4, 4), conv_kernel=(8, 4),
               num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, hidden_dropout=0.0,
               attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
               layerdrop=0.0, mask_time_prob=0.0, num_labels=LABELS, classifier_proj_size=16)

    def batch(n: int) -> dict[str, torch.Tensor]:
        return {"input_values": torch.randn(n, 400), "labels": torch.randint(0, LABELS, (n,))}
    return Case(Wav2Vec2ForSequenceClassification(cfg), batch)


def dinov2() -> Case:
    from transformers import Dinov2Config, Dinov2ForImageClassification

    cfg = _cfg(Dinov2Config, image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, mlp_ratio=2, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, num_labels=LABELS)
    return Case(Dinov2ForImageClassification(cfg), _image_batch())


def deit() -> Case:
    from transformers import DeiTConfig, DeiTForImageClassification

    cfg = _cfg(DeiTConfig, image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, num_labels=LABELS)
    return Case(DeiTForImageClassification(cfg), _image_batch())


def segformer() -> Case:
    """Efficient self-attention over a spatially reduced sequence."""
    from transformers import SegformerConfig, SegformerForImageClassification

    cfg = _cfg(SegformerConfig, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
               hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
               mlp_ratios=[2, 2], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               drop_path_rate=0.0, num_labels=LABELS)
    return Case(SegformerForImageClassification(cfg), _image_batch())


def clip_vision() -> Case:
    """CLIP's vision tower with a classification head."""
    from transformers import CLIPConfig, CLIPForImageClassification

    vision = dict(image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=64)
    text = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                intermediate_size=64)
    cfg = _cfg(CLIPConfig, vision_config=vision, text_config=text, num_labels=LABELS)
    return Case(CLIPForImageClassification(cfg), _image_batch())


def paligemma() -> Case:
    """A vision-language model: SigLIP's image tokens projected into Gemma's input embeddings
    (masked_scatter at the image token's places), a prefix-LM mask (token_type_ids), the
    image and prompt unlabelled (-100, the same count in every row). Its config keeps
    transformers' defaults, so its language model's config asks for a key/value cache (the
    top config has no use_cache of its own): rannc calls it without one."""
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        SiglipVisionConfig,
    )

    image_token, image_tokens, seq = VOCAB - 1, 16, SEQ + 16
    vision = SiglipVisionConfig(image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=64)
    text = GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       max_position_embeddings=64)
    cfg = _cfg(PaliGemmaConfig, vision_config=vision, text_config=text,
               image_token_index=image_token, projection_dim=32)

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(2, image_token, (n, seq))
        ids[:, :image_tokens] = image_token
        prefix = image_tokens + 4  # the image and a prompt of 4 tokens, attended both ways
        labels = ids.clone()
        labels[:, :prefix] = -100
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "token_type_ids": (torch.arange(seq) >= prefix).long().expand(n, seq).clone(),
                "pixel_values": torch.randn(n, 3, IMAGE, IMAGE), "labels": labels}
    return Case(PaliGemmaForConditionalGeneration(cfg), batch)


@_sequences
def recurrent_gemma() -> Case:
    """Griffin: RG-LRU recurrent blocks and local attention."""
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    cfg = _cfg(RecurrentGemmaConfig, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, lru_width=32,
               attention_window_size=8, conv1d_width=4, use_cache=False, pad_token_id=0,
               block_types=["recurrent", "recurrent", "attention"])
    return Case(RecurrentGemmaForCausalLM(cfg), _lm_batch())


@_sequences
def jamba() -> Case:
    """Mamba and attention layers, MoE feed-forwards (the scan's slow path, no CUDA kernels)."""
    from transformers import JambaConfig, JambaForCausalLM

    cfg = _cfg(JambaConfig, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
               expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0,
               mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_cache=False,
               use_mamba_kernels=False, pad_token_id=0)
    return Case(JambaForCausalLM(cfg), _lm_batch())


@_sequences
def mobilebert() -> Case:
    """Bottlenecks, stacked feed-forwards and its NoNorm."""
    from transformers import MobileBertConfig, MobileBertForMaskedLM

    cfg = _cfg(MobileBertConfig, vocab_size=VOCAB, hidden_size=32, embedding_size=16, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=64, intra_bottleneck_size=16,
               true_hidden_size=16, num_feedforward_networks=2, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, max_position_embeddings=64)
    return Case(MobileBertForMaskedLM(cfg), _lm_batch())


@_sequences
def squeezebert() -> Case:
    """Grouped 1-d convolutions in place of the dense layers."""
    from transformers import SqueezeBertConfig, SqueezeBertForSequenceClassification

    cfg = _cfg(SqueezeBertConfig, vocab_size=VOCAB, hidden_size=32, embedding_size=32, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=64, q_groups=2, k_groups=2, v_groups=2,
               post_attention_groups=2, intermediate_groups=2, output_groups=2,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64,
               num_labels=LABELS)
    return Case(SqueezeBertForSequenceClassification(cfg), _lm_batch(labels="class"))


@_sequences
def esm() -> Case:
    """Protein LM: rotary attention, token dropout (masked tokens' embeddings zeroed and rescaled)."""
    from transformers import EsmConfig, EsmForMaskedLM

    cfg = _cfg(EsmConfig, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=64, position_embedding_type="rotary",
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1,
               mask_token_id=3, token_dropout=True)
    return Case(EsmForMaskedLM(cfg), _lm_batch())


@_sequences
def canine() -> Case:
    """Characters hashed into embeddings, a strided convolution down and up again."""
    from transformers import CanineConfig, CanineForSequenceClassification

    cfg = _cfg(CanineConfig, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               downsampling_rate=2, num_hash_functions=4, num_hash_buckets=64, local_transformer_stride=4,
               max_position_embeddings=64, num_labels=LABELS)
    return Case(CanineForSequenceClassification(cfg), _lm_batch(vocab=200, seq=16, labels="class"))


def swinv2() -> Case:
    """Cosine attention with a learned logit scale, a log-spaced continuous position bias."""
    from transformers import Swinv2Config, Swinv2ForImageClassification

    cfg = _cfg(Swinv2Config, image_size=IMAGE, patch_size=4, embed_dim=16, depths=[2, 1],
               num_heads=[2, 4], window_size=4, mlp_ratio=2.0, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=LABELS)
    return Case(Swinv2ForImageClassification(cfg), _image_batch())


def beit() -> Case:
    """Relative position bias tables."""
    from transformers import BeitConfig, BeitForImageClassification

    cfg = _cfg(BeitConfig, image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, drop_path_rate=0.0, use_relative_position_bias=True,
               num_labels=LABELS)
    return Case(BeitForImageClassification(cfg), _image_batch())


def levit() -> Case:
    """BatchNorm; attention biases gathered by index."""
    from transformers import LevitConfig, LevitForImageClassification

    cfg = _cfg(LevitConfig, image_size=IMAGE, patch_size=16, hidden_sizes=[32, 48],
               num_attention_heads=[2, 3], depths=[1, 1], key_dim=[8, 8],
               down_ops=[["Subsample", 8, 2, 4, 2, 2]], num_labels=LABELS)
    return Case(LevitForImageClassification(cfg), _image_batch())


def mobilevit() -> Case:
    """BatchNorm; unfolded patches into transformer blocks and back."""
    from transformers import MobileViTConfig, MobileViTForImageClassification

    cfg = _cfg(MobileViTConfig, image_size=IMAGE, hidden_sizes=[32, 48, 64],
               neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64], num_attention_heads=2,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               classifier_dropout_prob=0.0, num_labels=LABELS)
    return Case(MobileViTForImageClassification(cfg), _image_batch())


@_sequences
def switch() -> Case:
    """Switch Transformer: top-1 routing to experts with a capacity."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    cfg = _cfg(SwitchTransformersConfig, vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
               num_decoder_layers=2, num_heads=4, num_experts=4, expert_capacity=64, dropout_rate=0.0,
               router_jitter_noise=0.0, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    return Case(SwitchTransformersForConditionalGeneration(cfg), _seq2seq_batch())


@_sequences
def mbart() -> Case:
    from transformers import MBartConfig, MBartForConditionalGeneration

    cfg = _cfg(MBartConfig, vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
               decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=1,
               use_cache=False)
    return Case(MBartForConditionalGeneration(cfg), _seq2seq_batch())


def speech_to_text() -> Case:
    """A 1-d convolutional subsampler over filterbank features."""
    from transformers import Speech2TextConfig, Speech2TextForConditionalGeneration

    cfg = _cfg(Speech2TextConfig, vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
               input_feat_per_channel=8, input_channels=1, conv_channels=16, max_source_positions=64,
               max_target_positions=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
               pad_token_id=0, eos_token_id=1, decoder_start_token_id=1, use_cache=False)

    def batch(n: int, frames: int = 24, labels: int = 6) -> dict[str, torch.Tensor]:
        return {"input_features": torch.randn(n, frames, 8),
                "labels": torch.randint(3, VOCAB, (n, labels))}
    # dynamic padding of both sides: 8 frames and 2 labels fewer (`Case.reshaped`)
    return Case(Speech2TextForConditionalGeneration(cfg), batch,
                reshaped=lambda n: batch(n, frames=16, labels=4))


def patchtst() -> Case:
    """Time series: per-series scaling, patching, BatchNorm in the encoder."""
    from transformers import PatchTSTConfig, PatchTSTForPrediction

    cfg = PatchTSTConfig(num_input_channels=3, context_length=32, patch_length=8, patch_stride=8,
                         prediction_length=8, d_model=32, num_attention_heads=4, num_hidden_layers=2,
                         ffn_dim=64, dropout=0.0, attention_dropout=0.0, ff_dropout=0.0,
                         positional_dropout=0.0, path_dropout=0.0, head_dropout=0.0)

    def batch(n: int) -> dict[str, torch.Tensor]:
        return {"past_values": torch.randn(n, 32, 3), "future_values": torch.randn(n, 8, 3)}
    return Case(PatchTSTForPrediction(cfg), batch)


# -- torch's own layers (nn.TransformerEncoder, nn.Transformer), as tutorials build models ---------
class TorchEncoderLM(nn.Module):
    """A causal language model on `nn.TransformerEncoder` (its defaults: post-norm, nested
    tensors enabled) given a causal mask and the padding mask, as torch's tutorials write it:
    the encoder compares the mask with a causal one to choose its kernel (rannc applies it as
    given: `_masks_applied_as_given`)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.pos = nn.Parameter(torch.randn(SEQ, 32) * 0.02)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(32))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor) -> dict[str, torch.Tensor]:
        seq = input_ids.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(seq, device=input_ids.device)
        h = self.encoder(self.embed(input_ids) + self.pos[:seq], mask=causal,
                         src_key_padding_mask=attention_mask == 0)
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


class TorchSeq2Seq(nn.Module):
    """`nn.Transformer` (encoder and decoder) with a causal target mask and padding masks on
    both sides."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.transformer = nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                decoder_input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(decoder_input_ids.shape[1])
        pad = attention_mask == 0
        h = self.transformer(self.embed(input_ids), self.embed(decoder_input_ids), tgt_mask=tgt_mask,
                             src_key_padding_mask=pad, memory_key_padding_mask=pad)
        logits = self.head(h)
        return {"loss": nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)),
                "logits": logits}


class TorchAttentionClassifier(nn.Module):
    """`nn.MultiheadAttention` (batch-first, a padding mask) with a residual LayerNorm and a
    masked mean over the tokens, as hand-written classifiers use it. Inside, the attention
    flattens (seq, batch, embed) to (seq * batch, embed), whose rows interleave the samples: a
    stage boundary there scrambled them (`rannc.graph.row_mixing.interleaved`)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, LABELS)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        a, weights = self.attn(h, h, h, key_padding_mask=attention_mask == 0)
        h = self.norm(h + a)
        keep = attention_mask.unsqueeze(-1).to(h.dtype)
        logits = self.head((h * keep).sum(1) / keep.sum(1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits,
                "attentions": weights}


def torch_attention() -> Case:
    return Case(TorchAttentionClassifier(), _lm_batch(labels="class"))


def torch_encoder() -> Case:
    return Case(TorchEncoderLM(), _lm_batch())


def torch_transformer() -> Case:
    base = _lm_batch(labels="")

    def batch(n: int) -> dict[str, torch.Tensor]:
        return {**base(n), "decoder_input_ids": torch.randint(3, VOCAB, (n, 8)),
                "labels": torch.randint(3, VOCAB, (n, 8))}
    return Case(TorchSeq2Seq(), batch)


# name -> (factory, source library, uses BatchNorm)


# -- diffusers: the models diffusion training runs (a conditional UNet as Stable Diffusion's, its
# VAE, a DiT). Their upsampling branches on the batch size (`contiguous()` from 64 rows on), which
# torch.export refused until 2026-12-08 ("Constraints violated (batch)").
def _diffusers() -> Any:
    try:
        import diffusers
    except Exception as e:  # noqa: BLE001 - any import failure means skip
        raise Unavailable(f"diffusers does not load: {type(e).__name__}: {e}") from e
    return diffusers


DIFFUSION_IMAGE = 16  # (latents: small images)


def _noisy_latents(channels: int, cond: tuple[int, int] | None = None) -> Callable[[int], Any]:
    def batch(n: int) -> dict[str, torch.Tensor]:
        b = {"sample": torch.randn(n, channels, DIFFUSION_IMAGE, DIFFUSION_IMAGE),
             "timestep": torch.randint(0, 1000, (n,))}
        if cond is not None:
            b["encoder_hidden_states"] = torch.randn(n, *cond)
        return b
    return batch


def sd_unet() -> Case:
    """diffusers' UNet2DConditionModel as Stable Diffusion's: ResNet blocks with the timestep
    embedding, cross-attention to text states, down- and upsampling (its upsampling's branch
    on the batch size), skip connections across the U."""
    torch.manual_seed(0)
    model = _diffusers().UNet2DConditionModel(
        sample_size=DIFFUSION_IMAGE, in_channels=4, out_channels=4, block_out_channels=(16, 32),
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=8,
        cross_attention_dim=24, attention_head_dim=8)
    return Case(model, _noisy_latents(4, (5, 24)))


def sd_vae() -> Case:
    """diffusers' AutoencoderKL (Stable Diffusion's VAE): encoder, a diagonal Gaussian's mode
    (sample_posterior=False), decoder with upsampling; GroupNorm and a mid-block attention."""
    torch.manual_seed(0)
    model = _diffusers().AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4,
        norm_num_groups=8, sample_size=DIFFUSION_IMAGE)

    def batch(n: int) -> dict[str, Any]:
        return {"sample": torch.randn(n, 3, DIFFUSION_IMAGE, DIFFUSION_IMAGE), "sample_posterior": False}
    return Case(model, batch)


def dit() -> Case:
    """diffusers' DiTTransformer2DModel: patches, adaptive LayerNorm from the timestep and class
    label embeddings, a transformer, unpatchify. Its class labels' dropout (for classifier-free
    guidance: a random draw per row, which on several ranks each rank draws for its own rows,
    as any dropout) is off, as the zoo's dropout is."""
    torch.manual_seed(0)
    model = _diffusers().DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        sample_size=8, patch_size=2, num_embeds_ada_norm=1000, norm_num_groups=8)
    for m in model.modules():
        if hasattr(m, "dropout_prob"):  # (diffusers' LabelEmbedding)
            m.dropout_prob = 0.0

    def batch(n: int) -> dict[str, torch.Tensor]:
        return {"hidden_states": torch.randn(n, 4, 8, 8), "timestep": torch.randint(0, 1000, (n,)),
                "class_labels": torch.randint(0, 1000, (n,))}
    return Case(model, batch)


MODELS: dict[str, tuple[Callable[[], Case], str, bool]] = {
    "llama": (llama, "transformers", False),
    "llama_masked": (llama_masked, "transformers", False),
    "mistral": (mistral, "transformers", False),
    "qwen2": (qwen2, "transformers", False),
    "qwen3": (qwen3, "transformers", False),
    "gemma": (gemma, "transformers", False),
    "phi": (phi, "transformers", False),
    "mixtral": (mixtral, "transformers", False),
    "phimoe": (phimoe, "transformers", False),
    "gpt2": (gpt2, "transformers", False),
    "gpt_neox": (gpt_neox, "transformers", False),
    "opt": (opt, "transformers", False),
    "falcon": (falcon, "transformers", False),
    "bloom": (bloom, "transformers", False),
    "gptj": (gptj, "transformers", False),
    "bert": (bert, "transformers", False),
    "roberta": (roberta, "transformers", False),
    "distilbert": (distilbert, "transformers", False),
    "albert": (albert, "transformers", False),
    "electra": (electra, "transformers", False),
    "yoso": (yoso, "transformers", False),
    "deberta_v2": (deberta_v2, "transformers", False),
    "t5": (t5, "transformers", False),
    "bart": (bart, "transformers", False),
    "whisper": (whisper, "transformers", False),
    "bert2gpt2": (bert2gpt2, "transformers", False),
    "vit": (vit, "transformers", False),
    "swin": (swin, "transformers", False),
    "convnext": (convnext, "transformers", False),
    "resnet": (resnet, "transformers", True),
    "mobilenet_v2": (mobilenet_v2, "transformers", True),
    "efficientnet": (efficientnet, "transformers", True),
    "regnet": (regnet, "transformers", True),
    "tv_resnet18": (tv_resnet18, "torchvision", True),
    "tv_mobilenet_v3": (tv_mobilenet_v3, "torchvision", True),
    "timm_vit": (timm_vit, "timm", False),
    "gemma2": (gemma2, "transformers", False),
    "gemma3": (gemma3, "transformers", False),
    "phi3": (phi3, "transformers", False),
    "olmo2": (olmo2, "transformers", False),
    "starcoder2": (starcoder2, "transformers", False),
    "stablelm": (stablelm, "transformers", False),
    "qwen2_moe": (qwen2_moe, "transformers", False),
    "gpt_bigcode": (gpt_bigcode, "transformers", False),
    "codegen": (codegen, "transformers", False),
    "mamba": (mamba, "transformers", False),
    "mamba2": (mamba2, "transformers", False),
    "deepseek_v3": (deepseek_v3, "transformers", False),
    "gpt_oss": (gpt_oss, "transformers", False),
    "modernbert": (modernbert, "transformers", False),
    "jetmoe": (jetmoe, "transformers", False),
    "xlnet": (xlnet, "transformers", False),
    "mpnet": (mpnet, "transformers", False),
    "funnel": (funnel, "transformers", False),
    "pegasus": (pegasus, "transformers", False),
    "m2m100": (m2m100, "transformers", False),
    "wav2vec2": (wav2vec2, "transformers", False),
    "dinov2": (dinov2, "transformers", False),
    "deit": (deit, "transformers", False),
    "segformer": (segformer, "transformers", False),
    "clip_vision": (clip_vision, "transformers", False),
    "paligemma": (paligemma, "transformers", False),
    "recurrent_gemma": (recurrent_gemma, "transformers", False),
    "jamba": (jamba, "transformers", False),
    "esm": (esm, "transformers", False),
    "canine": (canine, "transformers", False),
    "squeezebert": (squeezebert, "transformers", False),
    "mobilebert": (mobilebert, "transformers", False),
    "mbart": (mbart, "transformers", False),
    "switch": (switch, "transformers", False),
    "speech_to_text": (speech_to_text, "transformers", False),
    "patchtst": (patchtst, "transformers", True),
    "swinv2": (swinv2, "transformers", False),
    "beit": (beit, "transformers", False),
    "levit": (levit, "transformers", True),
    "mobilevit": (mobilevit, "transformers", True),
    "torch_attention": (torch_attention, "torch", False),
    "torch_encoder": (torch_encoder, "torch", False),
    "torch_transformer": (torch_transformer, "torch", False),
    "sd_unet": (sd_unet, "diffusers", False),
    "sd_vae": (sd_vae, "diffusers", False),
    "dit": (dit, "diffusers", False),
}
