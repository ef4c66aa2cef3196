"""``kvplugins kt``: the CPU MoE expert backend for SGLang's ``--kt-*`` flags.

kvplugins kt enable [--force]      install the kt_kernel shim (refuses over a real kt-kernel unless --force)
kvplugins kt disable               remove it
kvplugins kt status                shim state, kernels this CPU runs
kvplugins kt convert --input HF_DIR --output DIR --method bf16|int8|int4 [--group 128] [--threadpool-count N]
"""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("kt", help="CPU MoE experts for SGLang --kt-*: enable/disable/status the shim, convert weights")
    ksub = p.add_subparsers(dest="kt_command", metavar="KT_COMMAND", required=True)
    from kvplugins.shims import add_commands

    add_commands(ksub, "kt", "`import kt_kernel`")
    c = ksub.add_parser("convert", help="convert HF expert weights for --kt-weight-path")
    c.add_argument("--input", required=True, help="HF model directory (config.json + *.safetensors)")
    c.add_argument("--output", required=True, help="output directory (use as --kt-weight-path)")
    c.add_argument("--method", required=True, choices=("bf16", "int8", "int4"), help="weight format")
    c.add_argument("--group", type=int, default=128, help="int4: inputs per scale, a multiple of 64 (default 128)")
    c.add_argument(
        "--threadpool-count",
        type=int,
        default=1,
        help="accepted for kt-kernel parity; NUMA placement happens when the weights load",
    )
    c.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args) -> int:
    from kvplugins.kt_expert_backend import shim

    if args.kt_command == "convert":
        from kvplugins.kt_expert_backend.convert import convert

        meta = convert(
            args.input, args.output, args.method, args.group, args.threadpool_count, progress=not args.no_progress
        )
        print(
            f"converted {len(meta.layers)} MoE layers x {meta.num_experts} experts to {args.method} in "
            f"{args.output}; launch with --kt-weight-path {args.output} --kt-method "
            f"{ {'bf16': 'BF16', 'int8': 'AMXINT8', 'int4': 'AMXINT4'}[args.method] }"
        )
        return 0
    from kvplugins.shims import run_command

    st = run_command(shim.SHIM, args.kt_command, args)
    from kvplugins.config import load
    from kvplugins.kt_expert_backend.config import KTConfig
    from kvplugins.kt_expert_backend.native import describe_isa

    print(st.describe())
    print(f"kernels on this CPU: {describe_isa(load(KTConfig).isa)}")
    return 0
