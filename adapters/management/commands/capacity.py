"""`manage.py capacity`: how many adapters and sequences a card holds, before anyone buys one.

    python manage.py capacity --preset llama-2-7b --rank 16 --targets all-linear --adapters 1000 --gpu-gb 80
    python manage.py capacity --base my-base --rank 8 --targets q_proj,v_proj --adapters 50 --gpu-gb 24

GB means 10**9 bytes (see adapters.capacity). The arithmetic lives in adapters.capacity; this only parses
and prints.
"""
from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError, CommandParser

from adapters.capacity import (
    GB,
    PRESET_NAMES,
    TABLE_RANKS,
    TABLE_TARGETS,
    CapacityError,
    CapacityPlan,
    capacity_table,
    concurrent_at_mean,
    parse_fleet_mix,
    plan_capacity,
    plan_pool,
    preset_manifest,
)


def _n(value: int) -> str:
    return f"{value:,}"


class Command(BaseCommand):
    help = (
        "Plan GPU memory for a fleet of LoRA adapters on one base: per-adapter and fleet bytes, KV cache "
        "left, maximum concurrent sequences, and a rank x targets table. GB = 10**9 bytes."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--preset", choices=PRESET_NAMES, help="Published shapes of a well-known base.")
        source.add_argument("--base", metavar="SLUG", help="A registered base model (its shape manifest).")
        parser.add_argument("--rank", type=int, required=True, help="LoRA rank r.")
        parser.add_argument(
            "--targets",
            default="all-linear",
            help="attention-only (q,k,v,o), all-linear (all seven) or a comma list such as q_proj,v_proj.",
        )
        parser.add_argument("--adapters", type=int, required=True, help="Adapters resident on the card.")
        parser.add_argument("--gpu-gb", type=float, required=True, help="GPU memory in GB (10**9 bytes).")
        parser.add_argument("--context", type=int, default=4096, help="Tokens per sequence (default 4096).")
        parser.add_argument("--mean-tokens", type=int, default=None,
                            help="Mean tokens a sequence holds (prompt + answer): also show the concurrency at that "
                                 "mean, which a worker taking KV on demand reaches (the worst case is every "
                                 "sequence at --context).")
        parser.add_argument("--dtype", default="bf16", help="Weights dtype, base and adapters (default bf16).")
        parser.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: --dtype).")
        parser.add_argument("--block-size", type=int, default=16, help="Paged KV block size (default 16).")
        parser.add_argument("--json", action="store_true", help="Print the plan and table as JSON.")
        pool = parser.add_argument_group("the worker's memory pool (the arithmetic the worker sizes itself with)")
        pool.add_argument("--memory-gb", type=float, default=None,
                          help="A worker's budget (run_worker --memory-gb): prints its pool split and, with --mix, "
                               "what the fleet leaves for KV.")
        pool.add_argument("--mix", default="", help="Fleet mix RANK:TARGETS:COUNT,... e.g. 8:attention-only:500,"
                                                      "16:all-linear:300,4:q_proj+v_proj:200")
        pool.add_argument("--max-running", type=int, default=64, help="run_worker --max-running (default 64).")
        pool.add_argument("--prefill-chunk", type=int, default=256, help="run_worker --prefill-chunk (default 256).")
        pool.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="Where the worker runs.")
        pool.add_argument("--adapter-dtype", default=None,
                          help="run_worker --adapter-dtype: fp16 or bf16 beside an fp32 model halves each adapter's "
                               "pages (default: --dtype).")
        pool.add_argument("--max-lora-rank", type=int, default=None,
                          help="The base's max adapter rank (default: the registered base's, else the platform's).")

    def handle(self, *args, **opts) -> None:
        max_rank = opts["max_lora_rank"]
        if opts["preset"]:
            name = opts["preset"]
            manifest = preset_manifest(name)
            if max_rank is None:
                from django.conf import settings

                max_rank = settings.LORAFLEET_DEFAULT_MAX_RANK
        else:
            from adapters.models import BaseModel  # only --base needs the database

            name = opts["base"]
            base = BaseModel.objects.filter(slug=name).first()
            if base is None:
                raise CommandError(f"No registered base model {name!r} (see manage.py register_base).")
            manifest = base.shape_manifest
            max_rank = max_rank or base.max_lora_rank
        common = dict(
            dtype=opts["dtype"],
            num_adapters=opts["adapters"],
            gpu_gb=opts["gpu_gb"],
            context_len=opts["context"],
            kv_dtype=opts["kv_dtype"],
            block_size=opts["block_size"],
            base_name=name,
        )
        try:
            plan = plan_capacity(manifest, rank=opts["rank"], targets=opts["targets"], **common)
            table = capacity_table(manifest, **common)
        except CapacityError as exc:
            raise CommandError(str(exc)) from None

        pool = None
        if opts["memory_gb"] is not None:
            try:
                fleet = parse_fleet_mix(opts["mix"], manifest) if opts["mix"] else []
                pool = plan_pool(manifest, budget_bytes=int(opts["memory_gb"] * GB), dtype=opts["dtype"],
                                 block_size=opts["block_size"], max_running=opts["max_running"],
                                 prefill_chunk=opts["prefill_chunk"], max_lora_rank=max_rank, device=opts["device"],
                                 fleet=fleet, context_len=opts["context"], adapter_dtype=opts["adapter_dtype"])
            except CapacityError as exc:
                raise CommandError(str(exc)) from None
        mean = opts["mean_tokens"]
        try:
            if mean is not None:
                at_mean = concurrent_at_mean(plan.kv_bytes_left, plan.kv_bytes_per_token, plan.block_size, mean)
                if pool is not None:
                    f = pool["fleet"]
                    f["mean_tokens"] = mean
                    f["concurrent_sequences_at_mean"] = max(f["kv_pages"], 0) // -(-mean // opts["block_size"])
        except CapacityError as exc:
            raise CommandError(str(exc)) from None
        if opts["json"]:
            out = {"plan": plan.to_dict(), "table": [p.to_dict() for p in table]}
            if mean is not None:
                out["plan"]["mean_tokens"], out["plan"]["concurrent_sequences_at_mean"] = mean, at_mean
            if pool is not None:
                out["pool"] = pool
            self.stdout.write(json.dumps(out, indent=2))
            return
        if pool is not None:
            self.stdout.write(f"Base {name} ({plan.family})")
            self._print_pool(pool)
            return
        self._print_plan(plan, manifest)
        if mean is not None:
            self.stdout.write(f"At a mean of {mean} tokens a sequence (KV taken on demand): {_n(at_mean)} concurrent "
                              f"sequences")
        self._print_table(table, plan)

    def _print_pool(self, pool: dict) -> None:
        w, s, f = self.stdout.write, pool["split"], pool["fleet"]
        w(f"Budget {_n(s['budget_bytes'])} bytes = weights {_n(s['weights_bytes'])} + workspace "
          f"{_n(s['workspace_bytes'])} + pool {_n(s['pool_bytes'])} + unused {_n(s['unused_bytes'])}")
        w(f"Pool: {_n(s['num_pages'])} pages of {_n(s['page_bytes'])} bytes (one KV block of {s['block_size']} "
          f"tokens in every layer), shared by KV blocks and resident adapters")
        if f["pages_per_adapter"]:
            w(f"Adapter pages per fleet entry {f['pages_per_adapter']}; the whole fleet resident: "
              f"{_n(f['adapter_pages'])} pages")
        w(f"KV pages left {_n(f['kv_pages'])}: {_n(f['concurrent_sequences'])} concurrent sequences of "
          f"{f['context_len']} tokens ({f['blocks_per_sequence']} blocks each)")
        if "mean_tokens" in f:
            w(f"At a mean of {f['mean_tokens']} tokens a sequence (KV taken on demand): "
              f"{_n(f['concurrent_sequences_at_mean'])} concurrent sequences")

    def _print_plan(self, plan: CapacityPlan, manifest: dict) -> None:
        w = self.stdout.write
        w(
            f"Base {plan.base_name} ({plan.family}, {manifest['num_layers']} layers, hidden "
            f"{manifest['hidden_size']}, {manifest['num_key_value_heads']} KV heads x {manifest['head_dim']})"
        )
        w(
            f"Plan: rank {plan.rank}, targets {plan.targets_label}, {plan.dtype} weights, {plan.kv_dtype} KV, "
            f"{_n(plan.num_adapters)} adapters, {plan.gpu_bytes / GB:g} GB card (GB = 10^9 bytes), "
            f"context {plan.context_len}"
        )
        w("")
        w("Per adapter: r*(in+out)*layers per target")
        for module, params in plan.lora_params_by_module.items():
            mod = manifest["modules"][module]
            w(
                f"  {module:<10} {plan.rank}*({mod['in_features']}+{mod['out_features']})*{mod['layers']}"
                f" = {_n(params)}"
            )
        w(f"  LoRA parameters per adapter   {_n(plan.lora_params_per_adapter)}")
        w(f"  bytes per adapter             {_n(plan.adapter_bytes)}  ({plan.adapter_bytes / 1e6:.2f} MB)")
        w("")
        w(f"Fleet bytes ({_n(plan.num_adapters)} adapters)  {_n(plan.fleet_bytes)}  ({plan.fleet_bytes / GB:.2f} GB)")
        w(f"Base parameters               {_n(plan.base_params)}")
        w(f"Base bytes                    {_n(plan.base_bytes)}  ({plan.base_bytes / GB:.2f} GB)")
        w(f"KV bytes per token            {_n(plan.kv_bytes_per_token)}")
        blocks = plan.kv_bytes_per_sequence // (plan.kv_bytes_per_token * plan.block_size)
        w(
            f"KV bytes per sequence         {_n(plan.kv_bytes_per_sequence)}  ({plan.context_len} tokens in "
            f"{blocks} blocks of {plan.block_size})"
        )
        w(f"KV memory left on the card    {_n(plan.kv_bytes_left)}  ({plan.kv_bytes_left / GB:.2f} GB)")
        w(f"Max concurrent sequences      {_n(plan.max_concurrent_sequences)}")
        w("")
        style = self.style.SUCCESS if plan.fits and plan.max_concurrent_sequences else self.style.ERROR
        w(style(plan.verdict))

    def _print_table(self, table: list[CapacityPlan], plan: CapacityPlan) -> None:
        w = self.stdout.write
        w("")
        w(
            f"Rank x targets ({_n(plan.num_adapters)} adapters, {plan.gpu_bytes / GB:g} GB card, "
            f"context {plan.context_len}, ranks {'/'.join(map(str, TABLE_RANKS))} x {' / '.join(TABLE_TARGETS)})"
        )
        w(f"{'rank':>4}  {'targets':<15} {'adapter MB':>11} {'fleet GB':>10} {'KV left GB':>11} {'max seqs':>9}  fits")
        for row in table:
            fits = "yes" if row.fits and row.max_concurrent_sequences else "NO"
            w(
                f"{row.rank:>4}  {row.targets_label:<15} {row.adapter_bytes / 1e6:>11.2f} "
                f"{row.fleet_bytes / GB:>10.2f} {row.kv_bytes_left / GB:>11.2f} "
                f"{row.max_concurrent_sequences:>9,}  {fits}"
            )
