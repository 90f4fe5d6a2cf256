"""Hugging Face Trainer, Accelerate and torch.compile around a RaNNCModule.

Multi-rank checks run tests/scripts/hf_check.py under torchrun (see its docstring)."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
from mpi_harness import run_torchrun
from torch import nn

import rannc

pytestmark = pytest.mark.layer("multi_rank")

SCRIPT = Path(__file__).resolve().parent / "scripts" / "hf_check.py"


@pytest.mark.timeout(400)
def test_accelerate_prepare_and_trainer_checkpoint_resume(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    res = run_torchrun(SCRIPT, 2, ["--out", str(tmp_path / "run")], timeout=360)
    for what in ("accelerate", "trainer", "trainer-optimizers", "trainer-own-optimizer",
                 "trainer-masked", "trainer-ragged",
                 "trainer-ragged8", "trainer-bf16"):
        assert res.stdout.count(f"PASS {what} rank") == 2, res.stdout + res.stderr
    assert (tmp_path / "run" / "checkpoint-6" / "model.safetensors").is_file()


@pytest.mark.timeout(300)
def test_plain_trainer_checkpoint_fails_at_once_naming_rannc_trainer(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    t0 = time.monotonic()
    res = run_torchrun(SCRIPT, 2, ["--out", str(tmp_path / "run"), "--plain"], timeout=240,
                       check=False)
    assert res.returncode != 0
    assert "rannc.hf.RaNNCTrainer" in res.stderr, res.stderr
    assert time.monotonic() - t0 < 200  # not the 30 s collective timeout of a hung gather, twice


@pytest.mark.layer("single_process")
def test_trainer_subclass_wants_a_rannc_module() -> None:
    pytest.importorskip("accelerate")
    from rannc.hf import RaNNCTrainer

    with pytest.raises(rannc.RaNNCError, match="RaNNCModule"):
        RaNNCTrainer(model=nn.Linear(2, 2))


@pytest.mark.layer("single_process")
def test_trainer_pads_to_a_multiple_in_one_process(tmp_path: Path) -> None:
    """RaNNCTrainer(pad_to_multiple_of=8): a padding collator's batches of lengths 7, 9, 10 and 8
    are padded on to 8 and 16 (two captures, not four), hidden as the collator's own padding,
    and four SGD steps equal the unwrapped model's on the batches as the collator gave them."""
    pytest.importorskip("accelerate")
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    import hf_check

    from rannc.hf import RaNNCTrainer

    for bad in (0, -8, 2.5, True):
        with pytest.raises(rannc.RaNNCError, match=r"pad_to_multiple_of=.*positive int"):
            RaNNCTrainer(model=rannc.RaNNCModule(nn.Linear(2, 2)), pad_to_multiple_of=bad)
    data = hf_check.ragged_dataset()[:8]  # lengths 5, 7 | 9, 4 | 10, 3 | 6, 8
    trainer, wrapped, ref = hf_check.sgd_trainer(str(tmp_path), data, {"pad_to_multiple_of": 8},
                                                 data_collator=hf_check.pad_batch, max_steps=4)
    trainer.train()
    # each capture's inputs (after the call's layout): input_ids, attention_mask, labels of 8 or 16
    # positions beyond the batch dim, and num_items_in_batch
    lengths = [{leaf[2] for leaf in key[0][1:] if leaf[1]} for key in wrapped._deployments]
    assert sorted(lengths, key=str) == [{(16,)}, {(8,)}], lengths
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(4):
        batch = hf_check.pad_batch(data[2 * step:2 * step + 2])
        count = hf_check.label_count(trainer, [batch["labels"]])
        ref(**batch, num_items_in_batch=count).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    hf_check.assert_same_state(0, wrapped.state_dict(), ref)


@pytest.mark.layer("single_process")
def test_accelerate_mixed_precision_reaches_the_wrapped_model() -> None:
    """`Accelerator(mixed_precision="bf16")` runs a prepared model's forward under bf16 autocast
    and returns float32 outputs. Accelerate leaves a RaNNCModule as it is (no DDP around it),
    which skipped that wrap too: it ran in float32, silently (as under Trainer's bf16=True).
    Now the wrapper runs its calls as Accelerate runs a prepared model's: the loss, the outputs'
    dtype and the gradients equal the unwrapped model's prepared by the same Accelerator, and
    differ from float32's. A call already under the user's autocast is left to it."""
    accelerate = pytest.importorskip("accelerate")
    import copy
    import sys

    from accelerate.state import AcceleratorState

    sys.path.insert(0, str(SCRIPT.parent))
    import hf_check

    model = hf_check.gpt2()
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    ids = torch.randint(0, 97, (4, 10))
    AcceleratorState._reset_state(True)
    try:
        acc = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
        wrapped = acc.prepare(rannc.RaNNCModule(model))
        ref = acc.prepare(ref)
        out, want = wrapped(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
        assert out.logits.dtype is torch.float32
        torch.testing.assert_close(out.loss, want.loss, rtol=0, atol=0)
        torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=0)
        out.loss.backward()
        want.loss.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
        assert (out.logits - plain(input_ids=ids).logits).abs().max() > 1e-3  # (bf16's rounding)
        with torch.autocast("cpu", dtype=torch.float16):  # the user's own: no bf16 over it
            assert wrapped(input_ids=ids).logits.dtype is torch.float16
    finally:
        AcceleratorState._reset_state(True)


@pytest.mark.layer("single_process")
def test_peft_prefix_tuning_is_refused_naming_its_prefix() -> None:
    """PEFT's prefix tuning passes its prefix as a key/value cache, which the model returns
    whatever use_cache says: the refusal says so (it asked for use_cache=False alone, which the
    model already had)."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False))
    model = peft.get_peft_model(base, peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                               num_virtual_tokens=4))
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(rannc.OutputTypeError, match="PEFT's prefix tuning passes its prefix"):
        rannc.RaNNCModule(model)(input_ids=ids, labels=ids)


@pytest.mark.layer("single_process")
@pytest.mark.parametrize("peft_lora", [False, True], ids=["gpt2", "peft-lora-llama"])
def test_configs_asking_for_a_cache_train_as_they_come(peft_lora: bool,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A model whose config keeps transformers' default use_cache=True (every pretrained
    decoder's) returned a DynamicCache, which failed to capture until the user set use_cache=False
    by hand. rannc calls it with use_cache=False (said once, at INFO), exact to the unwrapped model
    called so, also through PEFT's forward(**kwargs); a use_cache=True passed on purpose is still
    refused with the fix."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if peft_lora:
        peft = pytest.importorskip("peft")
        base = LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
        model: nn.Module = peft.get_peft_model(base, peft.LoraConfig(
            task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                           n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                           attn_pdrop=0.0))
    assert model.config.use_cache is True
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model)
    ids = torch.randint(0, 64, (3, 8))
    with caplog.at_level("INFO", logger="rannc"):
        for _ in range(2):
            out = wrapped(input_ids=ids, labels=ids)
    want = ref(input_ids=ids, labels=ids, use_cache=False)
    assert out.get("past_key_values") is None and ref(input_ids=ids).past_key_values is not None
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=0)
    out.loss.backward()
    want.loss.backward()
    held = dict(ref.named_parameters())
    for name, p in wrapped.named_parameters():
        if p.requires_grad:
            # (LoRA's gradients sum in another order: 8e-11 apart)
            torch.testing.assert_close(p.grad, held[name].grad, rtol=1e-4, atol=1e-8)
    said = [r.getMessage() for r in caplog.records if "use_cache=False" in r.getMessage()]
    assert len(said) == 1 and "config.use_cache is True" in said[0], said
    # rannc.plan calls it as RaNNCModule does (before: the same capture error)
    planned = rannc.plan(ref, (), {"input_ids": ids, "labels": ids},
                         cluster=rannc.Cluster.homogeneous(n=2, per_node=2),
                         config=rannc.Config(partition_num=2, profiler="estimate"))
    assert len(planned.stages) == 2
    with pytest.raises(rannc.OutputTypeError, match="call it with use_cache=False"):
        wrapped(input_ids=ids, use_cache=True)
    # an encoder's config has use_cache too, but its forward names none: called as it is
    from transformers import BertConfig, BertForMaskedLM

    from rannc.calls import without_cache

    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, intermediate_size=64))
    assert bert.config.use_cache and without_cache(bert, {"input_ids": ids}) == {"input_ids": ids}


@pytest.mark.layer("single_process")
def test_a_vision_language_model_asking_for_a_cache_trains_as_it_comes(
        caplog: pytest.LogCaptureFixture) -> None:
    """A vision-language model's config (PaliGemma's, Llava's, Gemma 3's: a config of configs)
    has no use_cache of its own; its language model's asks for a cache, which forward returned,
    so it failed to capture (OutputTypeError) until its user passed use_cache=False. rannc now
    passes it, said once naming that config; CLIP, whose text model keeps no cache, is called
    as it is."""
    from conformance.zoo import paligemma
    from transformers import CLIPConfig, CLIPModel

    from rannc.calls import without_cache

    torch.manual_seed(0)
    case = paligemma()
    model = case.model
    assert getattr(model.config, "use_cache", None) is None and model.config.text_config.use_cache
    ref = copy.deepcopy(model)
    batch = case.batch(3)
    with caplog.at_level("INFO", logger="rannc"):
        out = rannc.RaNNCModule(model)(**batch)
    want = ref(**batch, use_cache=False)
    assert ref(**batch).past_key_values is not None and out.get("past_key_values") is None
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=0)
    torch.testing.assert_close(out.loss, want.loss, rtol=0, atol=0)
    said = [r.getMessage() for r in caplog.records if "use_cache=False" in r.getMessage()]
    assert len(said) == 1 and "config.text_config.use_cache is True" in said[0], said
    clip = CLIPModel(CLIPConfig(text_config=dict(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                 num_attention_heads=4, intermediate_size=64),
                                vision_config=dict(image_size=32, patch_size=8, hidden_size=32,
                                                   num_hidden_layers=1, num_attention_heads=4,
                                                   intermediate_size=64)))
    ids = {"input_ids": torch.randint(0, 64, (2, 8))}
    assert without_cache(clip, ids) == ids


@pytest.mark.layer("single_process")
def test_outer_torch_compile_says_to_use_compile_option() -> None:
    model = rannc.RaNNCModule(nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with pytest.raises(rannc.RaNNCError, match="compile=True"):
        torch.compile(model)(x)
    with pytest.raises(rannc.RaNNCError, match="compile=True"):
        model.compile()
    assert model(x).shape == (3, 2)  # the module itself is unharmed


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


@pytest.mark.layer("single_process")
@pytest.mark.timeout(400)
def test_compile_option_compiles_the_stages_and_stays_exact() -> None:
    import copy

    model = _mlp()
    ref = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model, compile=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(6, 8)
    for _ in range(2):
        out, ref_out = wrapped(x), ref(x)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        out.square().mean().backward()
        ref_out.square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    (dep,) = wrapped._deployments.values()
    assert all(type(m).__name__ == "OptimizedModule" for m in dep.modules)  # compiled, not eager


@pytest.mark.timeout(300)
def test_lightning_recipe_trains_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    """rannc.lightning.RaNNCStrategy on 2 ranks (torchrun): Lightning's own sampler and gradient
    accumulation, exact against the unwrapped model; the checkpoint its default callback saves
    holds the whole model and optimizer (before, with the single-device recipe, every rank
    took itself for rank 0, and a deployed RaNNCModule could not be loaded through its
    LightningModule: the keys it gathered under its parent's prefix were called unexpected);
    validate, and a resume from that checkpoint, exact (tests/scripts/lightning_check.py)."""
    pytest.importorskip("lightning")
    res = run_torchrun(Path(__file__).resolve().parent / "scripts" / "lightning_check.py", 2,
                       args=[tmp_path], timeout=240)
    assert res.stdout.count("PASS lightning rank") == 2, res.stdout + res.stderr


@pytest.mark.timeout(300)
def test_lightning_gan_with_manual_optimization_and_two_optimizers(tmp_path: Path) -> None:
    """Lightning's GAN recipe under RaNNCStrategy on 2 ranks: manual optimization, a generator and
    a discriminator each a RaNNCModule with its own optimizer, composed, and toggle_optimizer
    freezing the other's parameters for a step: an epoch exact against the unwrapped pair
    (tests/scripts/lightning_check.py gan)."""
    pytest.importorskip("lightning")
    res = run_torchrun(Path(__file__).resolve().parent / "scripts" / "lightning_check.py", 2,
                       args=[str(tmp_path), "gan"], timeout=240)
    assert res.stdout.count("PASS gan rank") == 2, res.stdout + res.stderr
