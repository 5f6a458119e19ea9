"""The training core (finetune/training.py) on a tiny local base: the loss mask, the loss itself against
transformers' plain forward, determinism, cancel, progress events and the errors for unusable data."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from demo.tiny_base import build_tiny_base
from finetune.training import (
    Cancelled,
    TrainSettings,
    _BatchLoss,
    _tokenizer,
    count_training_tokens,
    encode_example,
    shared_prefix_length,
    train_lora,
)

SETTINGS = TrainSettings(n_epochs=2, batch_size=3, learning_rate=1e-2, rank=4, alpha=8,
                         target_modules=("q_proj", "v_proj"), seed=7)


def chat(question: str, answer: str, *, system: str = "be brief") -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question},
                         {"role": "assistant", "content": answer}]}


EXAMPLES = [chat(q, a) for q, a in [
    ("where is the ball", "the ball is in the garden"), ("what did you do", "i played with the dog"),
    ("who is there", "it is the cat"), ("is it sunny", "yes the sun is out"),
    ("what is that", "that is a big tree"), ("can we go", "yes we can go now"),
    ("where is mom", "mom is in the kitchen"),
]]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_tiny_base(tmp_path_factory.mktemp("tiny-base"), hidden=32, layers=2, heads=4, kv_heads=2,
                           intermediate=64, vocab=400, max_position=128)


def quiet(event: dict) -> None:
    pass


def never() -> bool:
    return False


def weights_sha(folder: Path) -> str:
    return hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest()


def test_mask_is_the_assistant_turns_with_weight_1_and_their_end_token(base):
    """Hand-built: each piece of the ChatML rendering tokenized on its own, flagged by hand."""
    tok = _tokenizer(str(base))
    example = {"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "where is the ball"},
        {"role": "assistant", "content": "in the garden", "weight": 0},
        {"role": "user", "content": "and the dog"},
        {"role": "assistant", "content": "the dog is out"},
    ]}
    pieces = [  # (text, is it a target?)
        ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhere is the ball<|im_end|>\n"
         "<|im_start|>assistant\nin the garden<|im_end|>\n", False),  # weight 0: not learnt
        ("<|im_start|>user\nand the dog<|im_end|>\n<|im_start|>assistant\n", False),
        ("the dog is out", True), ("<|im_end|>", True),   # the answer and the end of the turn
        ("\n", False),                                     # what the template writes after the turn
    ]
    ids, mask = [], []
    for text, flag in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [flag] * len(piece)
    encoded = encode_example(tok, example)
    assert list(encoded.ids) == ids
    assert list(encoded.target) == mask
    # and the ids are exactly transformers' own rendering + tokenization of the conversation
    assert list(encoded.ids) == list(tok.apply_chat_template(example["messages"], tokenize=True, return_dict=False))


def test_count_training_tokens_is_the_chat_template_length(base):
    tok = _tokenizer(str(base))
    counts = count_training_tokens(base, EXAMPLES[:3])
    assert counts == [len(tok.apply_chat_template(e["messages"], tokenize=True, return_dict=False)) for e in EXAMPLES[:3]]


def test_batch_loss_and_gradients_equal_the_plain_forward(base):
    """The shared-prefix, targets-only loss is the mean cross-entropy of transformers' full forward on the
    assistant tokens, and so are its gradients on the LoRA weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                      lora_dropout=0.0, task_type="CAUSAL_LM"))
    for name, p in model.named_parameters():  # lora_B starts at zero: make the adapter do something
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    tok = _tokenizer(str(base))
    batch = [encode_example(tok, e) for e in EXAMPLES[:4]]
    p = shared_prefix_length(batch)
    assert p > 0  # the system prompt is shared
    summed, n = _BatchLoss(model, prefix=batch[0].ids[:p], pad_id=0, device=torch.device("cpu")).sums(batch)
    (summed / n).backward()
    ours = {k: v.grad.clone() for k, v in model.named_parameters() if v.requires_grad}
    model.zero_grad()
    total, count = 0.0, 0
    for e in batch:
        logits = model(input_ids=torch.tensor([e.ids])).logits[0]  # [T, V]
        keep = torch.tensor(e.target[1:])
        total = total + F.cross_entropy(logits[:-1][keep], torch.tensor(e.ids[1:])[keep], reduction="sum")
        count += int(keep.sum())
    plain = total / count
    plain.backward()
    assert n == count
    torch.testing.assert_close(summed / n, plain, rtol=1e-5, atol=1e-5)
    for k, v in model.named_parameters():
        if v.requires_grad:
            torch.testing.assert_close(ours[k], v.grad, rtol=1e-4, atol=1e-6)


def test_same_data_and_seed_give_a_byte_identical_adapter(base, tmp_path):
    events: list[dict] = []
    a = train_lora(base, EXAMPLES, EXAMPLES[:2], SETTINGS, tmp_path / "a", on_event=events.append,
                   should_cancel=never)
    b = train_lora(base, EXAMPLES, EXAMPLES[:2], SETTINGS, tmp_path / "b", on_event=quiet, should_cancel=never)
    assert (a.adapter_dir / "adapter_config.json").is_file()
    assert weights_sha(a.adapter_dir) == weights_sha(b.adapter_dir)
    assert (a.train_loss, a.valid_loss) == (b.train_loss, b.valid_loss)
    other = train_lora(base, EXAMPLES, None, TrainSettings(**{**SETTINGS.__dict__, "seed": 8}), tmp_path / "c",
                       on_event=quiet, should_cancel=never)
    assert weights_sha(other.adapter_dir) != weights_sha(a.adapter_dir)
    # 7 examples in batches of 3: 3 steps an epoch, 2 epochs
    assert a.steps == 6
    assert a.trained_tokens == 2 * sum(count_training_tokens(base, EXAMPLES))
    metrics = [e for e in events if e["type"] == "metrics"]
    assert [e["step"] for e in metrics] == [1, 2, 3, 4, 5, 6]
    assert {e["total_steps"] for e in metrics} == {6}
    assert all(e["train_loss"] > 0 for e in metrics)
    assert a.valid_loss is not None and a.valid_loss > 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_training_lowers_the_loss_and_the_adapter_loads_in_peft(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    settings = TrainSettings(n_epochs=25, batch_size=7, learning_rate=5e-2, rank=8, alpha=16,
                             target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=1)
    events: list[dict] = []
    result = train_lora(base, EXAMPLES, None, settings, tmp_path / "out", on_event=events.append, should_cancel=never)
    losses = [e["train_loss"] for e in events if e["type"] == "metrics"]
    assert losses[-1] < losses[0] * 0.7
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(result.adapter_dir))
    assert model.peft_config["default"].r == 8


def test_cancel_between_steps_raises_and_writes_nothing(base, tmp_path):
    events: list[dict] = []

    def after_two_steps() -> bool:
        return sum(e["type"] == "metrics" for e in events) >= 2

    with pytest.raises(Cancelled):
        train_lora(base, EXAMPLES, None, SETTINGS, tmp_path / "out", on_event=events.append,
                   should_cancel=after_two_steps)
    assert [e["step"] for e in events if e["type"] == "metrics"] == [1, 2]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("examples", "message"), [
    ([chat("hi", "there"), {"messages": [{"role": "user", "content": "no answer"}]}],
     "example 2 (line 2 of its file): no assistant message with weight 1"),
    ([{"messages": [{"role": "robot", "content": "x"}]}], "example 1 (line 1 of its file): message 1 has role 'robot'"),
    ([{"prompt": "x"}], "expected an object with a non-empty \"messages\" list"),
    ([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 0}]}],
     "no assistant message with weight 1"),
    ([chat("hi", "word " * 200)], "more than the base's context of 128 tokens"),
    ([], "holds no examples"),
])
def test_unusable_data_is_a_value_error_naming_the_example(base, tmp_path, examples, message):
    with pytest.raises(ValueError) as err:
        train_lora(base, examples, None, SETTINGS, tmp_path / "out", on_event=quiet, should_cancel=never)
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()


def test_unusable_settings_are_named(base, tmp_path):
    bad = TrainSettings(n_epochs=0, batch_size=2, learning_rate=1e-3, rank=4, alpha=8,
                        target_modules=("no_such_proj",), seed=0)
    with pytest.raises(ValueError, match="n_epochs must be a whole number >= 1"):
        train_lora(base, EXAMPLES, None, bad, tmp_path / "out", on_event=quiet, should_cancel=never)
    with pytest.raises(ValueError, match="no_such_proj"):
        train_lora(base, EXAMPLES, None, TrainSettings(**{**bad.__dict__, "n_epochs": 1}), tmp_path / "out",
                   on_event=quiet, should_cancel=never)


def test_a_held_training_writes_the_same_adapter_and_is_held_in_every_layer_and_lora_gradient(base, tmp_path):
    """The trainer's pause (transport.busy.YieldGate.wait) is called before every decoder layer's forward and
    after every LoRA weight's gradient: holding there changes when training computes, never what."""
    calls = []

    def pause() -> None:
        calls.append(1)
        if len(calls) % 7 == 0:  # held now and then, as while an inference engine runs requests
            import time
            time.sleep(0.002)

    held = train_lora(base, EXAMPLES, EXAMPLES[:2], SETTINGS, tmp_path / "held", on_event=quiet, should_cancel=never,
                      pause=pause)
    free = train_lora(base, EXAMPLES, EXAMPLES[:2], SETTINGS, tmp_path / "free", on_event=quiet, should_cancel=never)
    assert weights_sha(held.adapter_dir) == weights_sha(free.adapter_dir)
    assert (held.train_loss, held.valid_loss) == (free.train_loss, free.valid_loss)
    # 6 steps x (2 forwards, the shared prefix's and the batch's, of 2 layers + 2 layers x 2 targets x (A, B)
    # gradients) + 6 step starts, plus validation's two forwards of 2 layers
    assert len(calls) == 6 * (2 * 2 + 8) + 6 + 2 * 2
