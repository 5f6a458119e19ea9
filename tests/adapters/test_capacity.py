"""The capacity planner's arithmetic, checked against figures computed by hand (the working is in the
comments), and `manage.py capacity` as an operator reads it. GB = 10**9 bytes throughout."""
from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from adapters.capacity import (
    CapacityError,
    base_parameter_count,
    base_parameters,
    capacity_table,
    kv_bytes_per_token,
    plan_capacity,
    preset_manifest,
)


# --- presets: shapes from the published configs give the published parameter counts ----------------
@pytest.mark.parametrize(
    "preset, expected",
    [
        # Llama-2-7B: V=32000 h=4096 i=11008 L=32 H=KV=32 hd=128, untied.
        #   embeddings 2*32000*4096 = 262,144,000
        #   per layer  4*4096*4096 (q,k,v,o) = 67,108,864 + 3*4096*11008 = 135,266,304 + 2*4096 norms
        #              = 202,383,360;  *32 = 6,476,267,520;  + final norm 4096
        #   total 262,144,000 + 6,476,267,520 + 4,096 = 6,738,415,616
        ("llama-2-7b", 6_738_415_616),
        # Llama-3-8B: V=128256 h=4096 i=14336 L=32 H=32 KV=8 hd=128, untied.
        #   embeddings 2*128256*4096 = 1,050,673,152
        #   per layer  2*4096*4096 (q,o) + 2*4096*1024 (k,v) = 41,943,040 + 3*4096*14336 = 176,160,768
        #              + 8192 = 218,112,000;  *32 = 6,979,584,000;  + 4096
        #   total 8,030,261,248
        ("llama-3-8b", 8_030_261_248),
        # Mistral-7B: Llama-3-8B's layers with V=32000: 262,144,000 + 6,979,584,000 + 4096
        ("mistral-7b", 7_241_732_096),
        # Qwen2-7B: V=152064 h=3584 i=18944 L=28 H=28 KV=4 hd=128, untied, q/k/v biases.
        #   embeddings 2*152064*3584 = 1,089,994,752
        #   per layer  2*3584*3584 + 2*3584*512 = 29,360,128; biases 3584+512+512 = 4,608;
        #              3*3584*18944 = 203,685,888; norms 7,168  -> 233,057,792;  *28 = 6,525,618,176
        #   total 1,089,994,752 + 6,525,618,176 + 3,584 = 7,615,616,512
        ("qwen2-7b", 7_615_616_512),
        # Gemma-2-9B: V=256000 h=3584 i=14336 L=42 H=16 KV=8 hd=256, tied, four RMSNorms a layer.
        #   embeddings 256000*3584 = 917,504,000 (once: the head is the table)
        #   per layer  2*3584*4096 (q,o) + 2*3584*2048 (k,v) = 44,040,192 + 3*3584*14336 = 154,140,672
        #              + 4*3584 norms = 14,336 -> 198,195,200;  *42 = 8,324,198,400
        #   total 917,504,000 + 8,324,198,400 + 3,584 = 9,241,705,984 (with 2 norms a layer: 150,528 fewer)
        ("gemma-2-9b", 9_241_705_984),
        # Gemma-3-1B: V=262144 h=1152 i=6912 L=26 H=4 KV=1 hd=256, tied, q/k norms [256] each, four RMSNorms.
        #   embeddings 262144*1152 = 301,989,888
        #   per layer  2*1152*1024 + 2*1152*256 = 2,949,120 + 3*1152*6912 = 23,887,872 + q/k norms 512
        #              + 4*1152 = 4,608 -> 26,842,112;  *26 = 697,894,912
        #   total 301,989,888 + 697,894,912 + 1,152 = 999,885,952
        ("gemma-3-1b", 999_885_952),
    ],
)
def test_preset_base_parameter_count_matches_the_published_count(preset, expected):
    assert base_parameter_count(preset_manifest(preset)) == expected


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_gemma_checkpoints_formula_count_is_what_its_safetensors_hold(tmp_path, arch, tied):
    """Gemma's layers hold four RMSNorms (and Gemma 3 the q/k norms): the formula, which plans a base registered
    from a config alone, counts what a Gemma checkpoint's safetensors headers say it holds."""
    from adapters.manifest import shape_manifest_from_checkpoint
    from demo.tiny_gemma import build_tiny_gemma

    manifest = shape_manifest_from_checkpoint(build_tiny_gemma(tmp_path / arch, arch=arch, tie_embeddings=tied))
    assert manifest["tie_word_embeddings"] is tied
    assert manifest["num_parameters"] > 0
    assert base_parameter_count(manifest) == manifest["num_parameters"]


def test_a_checkpoints_own_parameter_count_wins_over_the_formula():
    manifest = preset_manifest("llama-2-7b")
    manifest["num_parameters"] = 1234  # read from safetensors headers when registered from a checkpoint
    assert base_parameters(manifest) == 1234


def test_tied_embeddings_count_the_vocabulary_matrix_once():
    manifest = preset_manifest("llama-2-7b")
    manifest["tie_word_embeddings"] = True
    assert base_parameter_count(manifest) == 6_738_415_616 - 32000 * 4096


# --- hand-computed plans ---------------------------------------------------------------------------
def test_llama2_rank16_all_linear_100_adapters_on_80gb():
    plan = plan_capacity(
        preset_manifest("llama-2-7b"), rank=16, targets="all-linear", dtype="bf16",
        num_adapters=100, gpu_gb=80, context_len=4096, kv_dtype="bf16",
    )
    # q,k,v,o: 16*(4096+4096)*32 = 4,194,304 each;  gate,up,down: 16*(4096+11008)*32 = 7,733,248 each
    assert plan.lora_params_by_module["q_proj"] == 4_194_304
    assert plan.lora_params_by_module["down_proj"] == 7_733_248
    # 4*4,194,304 + 3*7,733,248 = 16,777,216 + 23,199,744 = 39,976,960 parameters; *2 bytes (bf16)
    assert plan.lora_params_per_adapter == 39_976_960
    assert plan.adapter_bytes == 79_953_920  # the "80 MB adapter" of DESIGN.md
    assert plan.fleet_bytes == 7_995_392_000  # *100
    assert plan.base_params == 6_738_415_616
    assert plan.base_bytes == 13_476_831_232  # *2
    # KV: 32 layers * 2 * 32 kv heads * 128 * 2 bytes = 524,288 per token; *4096 = 2,147,483,648
    assert plan.kv_bytes_per_token == 524_288
    assert plan.kv_bytes_per_sequence == 2_147_483_648
    # 80,000,000,000 - 13,476,831,232 - 7,995,392,000 = 58,527,776,768
    assert plan.gpu_bytes == 80_000_000_000
    assert plan.kv_bytes_left == 58_527_776_768
    # 58,527,776,768 // 2,147,483,648 = 27  (27*2,147,483,648 = 57,982,058,496; 28* = 60,129,542,144)
    assert plan.max_concurrent_sequences == 27
    assert plan.fits
    assert plan.verdict.startswith("FITS: 27 concurrent sequences")


def test_llama3_rank8_attention_only_500_adapters_grouped_query_kv():
    plan = plan_capacity(
        preset_manifest("llama-3-8b"), rank=8, targets="attention-only", dtype="bf16",
        num_adapters=500, gpu_gb=80, context_len=8192,
    )
    # q,o: 8*(4096+4096)*32 = 2,097,152;  k,v: 8*(4096+1024)*32 = 1,310,720  (8 kv heads * 128 = 1024)
    assert plan.targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert plan.lora_params_by_module == {
        "q_proj": 2_097_152, "k_proj": 1_310_720, "v_proj": 1_310_720, "o_proj": 2_097_152,
    }
    assert plan.lora_params_per_adapter == 6_815_744
    assert plan.adapter_bytes == 13_631_488
    assert plan.fleet_bytes == 6_815_744_000
    assert plan.base_bytes == 16_060_522_496  # 8,030,261,248 * 2
    # 32 * 2 * 8 * 128 * 2 = 131,072 per token (a quarter of Llama-2's: GQA); *8192 = 1,073,741,824
    assert plan.kv_bytes_per_token == 131_072
    assert plan.kv_bytes_per_sequence == 1_073_741_824
    # 80e9 - 16,060,522,496 - 6,815,744,000 = 57,123,733,504;  // 1,073,741,824 = 53
    assert plan.kv_bytes_left == 57_123_733_504
    assert plan.max_concurrent_sequences == 53


def test_qwen2_explicit_targets_and_fp8_kv():
    plan = plan_capacity(
        preset_manifest("qwen2-7b"), rank=4, targets=["q_proj", "v_proj"], dtype="fp16",
        num_adapters=10, gpu_gb=24, context_len=2048, kv_dtype="fp8",
    )
    # q: 4*(3584+3584)*28 = 802,816;  v: 4*(3584+512)*28 = 458,752;  total 1,261,568; *2 bytes
    assert plan.lora_params_per_adapter == 1_261_568
    assert plan.adapter_bytes == 2_523_136
    assert plan.targets_label == "q_proj,v_proj"
    # 28 * 2 * 4 * 128 * 1 byte = 28,672 per token; *2048 = 58,720,256
    assert plan.kv_bytes_per_token == 28_672
    assert plan.kv_bytes_per_sequence == 58_720_256
    # 24e9 - 15,231,233,024 (7,615,616,512*2) - 25,231,360 = 8,743,535,616;  // 58,720,256 = 148
    assert plan.kv_bytes_left == 8_743_535_616
    assert plan.max_concurrent_sequences == 148


def test_a_sequence_occupies_whole_kv_blocks():
    plan = plan_capacity(preset_manifest("llama-3-8b"), rank=8, context_len=1000, block_size=16)
    # 1000 tokens -> 63 blocks of 16 = 1008 token slots; 131,072 * 1008 = 132,120,576
    assert plan.kv_bytes_per_sequence == 132_120_576


def test_fleet_plus_base_over_the_card_does_not_fit():
    plan = plan_capacity(
        preset_manifest("llama-2-7b"), rank=16, targets="all-linear", num_adapters=1000, gpu_gb=80,
    )
    # 13,476,831,232 + 1000 * 79,953,920 = 93,430,751,232 > 80,000,000,000
    assert plan.fleet_bytes == 79_953_920_000
    assert plan.kv_bytes_left == -13_430_751_232
    assert not plan.fits
    assert plan.max_concurrent_sequences == 0
    # (80e9 - 13,476,831,232 - 2,147,483,648) // 79,953,920 = 64,375,685,120 // 79,953,920 = 805
    assert plan.max_resident_adapters == 805
    assert plan.verdict.startswith("DOES NOT FIT")
    assert "13.43 GB over" in plan.verdict


def test_weights_that_fit_but_leave_no_room_for_one_sequence_do_not_fit():
    plan = plan_capacity(preset_manifest("llama-2-7b"), rank=16, num_adapters=1, gpu_gb=15)
    # 15e9 - 13,476,831,232 - 79,953,920 = 1,443,214,848 < 2,147,483,648 for one 4096-token sequence
    assert plan.fits and plan.kv_bytes_left == 1_443_214_848
    assert plan.max_concurrent_sequences == 0
    assert plan.verdict.startswith("DOES NOT FIT: the weights fit")


def test_table_covers_ranks_by_target_presets_and_shows_the_trade_off():
    table = capacity_table(preset_manifest("llama-2-7b"), num_adapters=1000, gpu_gb=80)
    assert [(p.rank, p.targets_label) for p in table] == [
        (r, t) for r in (4, 8, 16, 32, 64) for t in ("attention-only", "all-linear")
    ]
    row = {(p.rank, p.targets_label): p for p in table}
    # rank 4 attention-only: 4*8192*32*4 = 4,194,304 params, 8,388,608 bytes; *1000 = 8,388,608,000
    # 80e9 - 13,476,831,232 - 8,388,608,000 = 58,134,560,768 // 2,147,483,648 = 27
    assert row[(4, "attention-only")].max_concurrent_sequences == 27
    # rank 8 all-linear: half of rank 16's 79,953,920 bytes -> 39,976,960,000 fleet
    # 80e9 - 13,476,831,232 - 39,976,960,000 = 26,546,208,768 // 2,147,483,648 = 12
    assert row[(8, "all-linear")].max_concurrent_sequences == 12
    # rank 32 attention-only: 67,108,864,000 fleet + base = 80,585,695,232 > 80e9: does not fit
    assert not row[(32, "attention-only")].fits
    sequences = [row[(r, "all-linear")].max_concurrent_sequences for r in (4, 8, 16, 32, 64)]
    assert sequences == sorted(sequences, reverse=True)  # higher rank never buys concurrency


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"targets": "lm_head"}, "Unknown target module"),
        ({"dtype": "int3"}, "Unknown dtype"),
        ({"rank": 0}, "rank must be positive"),
        ({"gpu_gb": 0}, "GPU memory must be positive"),
    ],
)
def test_nonsense_inputs_are_refused_with_a_reason(kwargs, message):
    args = {"rank": 8, **kwargs}
    with pytest.raises(CapacityError, match=message):
        plan_capacity(preset_manifest("mistral-7b"), **args)


def test_unknown_preset_names_the_choices():
    with pytest.raises(CapacityError, match="llama-2-7b"):
        preset_manifest("gpt-5")


def test_kv_dtype_defaults_to_the_weights_dtype():
    manifest = preset_manifest("mistral-7b")
    plan = plan_capacity(manifest, rank=8, dtype="fp32")
    assert plan.kv_bytes_per_token == kv_bytes_per_token(manifest, "fp32") == 32 * 2 * 8 * 128 * 4


# --- manage.py capacity ----------------------------------------------------------------------------
def _capacity(*args: str) -> str:
    out = StringIO()
    call_command("capacity", *args, stdout=out, no_color=True)
    return out.getvalue()


def test_command_prints_the_issue_example_and_says_it_does_not_fit():
    text = _capacity(
        "--preset", "llama-2-7b", "--rank", "16", "--targets", "all-linear", "--adapters", "1000", "--gpu-gb", "80",
    )
    assert "16*(4096+11008)*32 = 7,733,248" in text
    assert "LoRA parameters per adapter   39,976,960" in text
    assert "bytes per adapter             79,953,920" in text
    assert "79,953,920,000" in text  # fleet
    assert "13,476,831,232" in text  # base
    assert "KV bytes per token            524,288" in text
    assert "KV memory left on the card    -13,430,751,232" in text
    assert "Max concurrent sequences      0" in text
    assert "DOES NOT FIT" in text
    table = text.split("Rank x targets", 1)[1].splitlines()[2:]
    assert len(table) == 10
    assert table[0].split()[:2] == ["4", "attention-only"] and table[0].split()[-1] == "yes"
    assert table[5].split()[:2] == ["16", "all-linear"] and table[5].split()[-1] == "NO"


def test_command_json_matches_the_library():
    text = _capacity(
        "--preset", "llama-3-8b", "--rank", "8", "--targets", "attention-only", "--adapters", "500",
        "--gpu-gb", "80", "--context", "8192", "--json",
    )
    data = json.loads(text)
    assert data["plan"]["max_concurrent_sequences"] == 53
    assert data["plan"]["fits"] is True
    assert len(data["table"]) == 10


def test_command_refuses_unknown_targets():
    with pytest.raises(CommandError, match="Unknown target module"):
        _capacity("--preset", "llama-2-7b", "--rank", "8", "--targets", "q_proj,embed_tokens",
                  "--adapters", "1", "--gpu-gb", "80")


@pytest.mark.django_db
def test_command_plans_a_registered_base_from_its_manifest():
    from adapters.models import BaseModel

    manifest = preset_manifest("mistral-7b")
    manifest["num_parameters"] = 7_241_732_096
    BaseModel.objects.create(
        slug="mistral", display_name="Mistral", sha256="0" * 64, architecture="mistral",
        shape_manifest=manifest, queue_name="base.mistral",
    )
    text = _capacity("--base", "mistral", "--rank", "8", "--targets", "q_proj,v_proj", "--adapters", "10",
                     "--gpu-gb", "40", "--context", "4096")
    # q: 8*(4096+4096)*32 = 2,097,152;  v: 8*(4096+1024)*32 = 1,310,720;  total 3,407,872
    assert "LoRA parameters per adapter   3,407,872" in text
    assert "Base bytes                    14,483,464,192" in text  # 7,241,732,096 * 2
    with pytest.raises(CommandError, match="No registered base model 'nope'"):
        _capacity("--base", "nope", "--rank", "8", "--adapters", "1", "--gpu-gb", "40")


def test_command_shows_the_concurrency_at_a_mean_length_beside_the_worst_case():
    """KV is taken on demand: at a mean of 512 tokens a sequence, the 80 GB card of the 100-adapter plan runs
    58,527,776,768 // (32 blocks * 16 * 524,288) = 218 sequences, where 27 fit at the full 4,096-token context."""
    args = ("--preset", "llama-2-7b", "--rank", "16", "--targets", "all-linear", "--adapters", "100", "--gpu-gb", "80")
    text = _capacity(*args, "--mean-tokens", "512")
    assert "Max concurrent sequences      27" in text
    assert "At a mean of 512 tokens a sequence (KV taken on demand): 218 concurrent sequences" in text
    data = json.loads(_capacity(*args, "--mean-tokens", "500", "--json"))  # 500 tokens still take 32 blocks
    assert data["plan"]["concurrent_sequences_at_mean"] == 218
    with pytest.raises(CommandError, match="at least one token"):
        _capacity(*args, "--mean-tokens", "0")


# Phi-3-mini-4k-instruct's config.json (https://huggingface.co/microsoft/Phi-3-mini-4k-instruct), the fields read
PHI3_MINI = {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
             "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.mark.django_db
def test_command_names_the_family_of_a_registered_base_and_plans_in_its_module_names():
    from adapters.manifest import shape_manifest_from_config
    from adapters.models import BaseModel

    BaseModel.objects.create(slug="phi3-mini", display_name="Phi-3 mini", sha256="0" * 64, architecture="phi3",
                             shape_manifest=shape_manifest_from_config(PHI3_MINI), queue_name="base.phi3-mini")
    args = ("--base", "phi3-mini", "--rank", "8", "--targets", "attention-only", "--adapters", "10", "--gpu-gb", "40")
    text = _capacity(*args)
    assert text.startswith("Base phi3-mini (phi3, 32 layers, hidden 3072, 32 KV heads x 96)")
    # qkv_proj: 8*(3072+9216)*32 = 3,145,728;  o_proj: 8*(3072+3072)*32 = 1,572,864
    assert "qkv_proj   8*(3072+9216)*32 = 3,145,728" in text and "o_proj     8*(3072+3072)*32 = 1,572,864" in text
    assert json.loads(_capacity(*args, "--json"))["plan"]["family"] == "phi3"
    assert _capacity(*args, "--memory-gb", "16").startswith("Base phi3-mini (phi3)\nBudget ")
    assert json.loads(_capacity("--preset", "qwen3-8b", "--rank", "8", "--adapters", "1", "--gpu-gb", "80",
                                "--json"))["plan"]["family"] == "qwen3"
