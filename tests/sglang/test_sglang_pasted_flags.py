"""What `kvplugins up` prints for SGLang works when pasted (issue #31): SGLang's own argument parser reads it as
HiCache on, with our storage backend (embedded.SGLANG_FLAGS, the same text flags_text prints)."""

import argparse
import json
import shlex

from kvplugins.store.embedded import SGLANG_FLAGS, flags_text


def test_sglang_reads_the_printed_flags():
    from sglang.srt.server_args import ServerArgs

    assert SGLANG_FLAGS in flags_text("127.0.0.1:5555")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", *shlex.split(SGLANG_FLAGS)])
    assert args.enable_hierarchical_cache is True and args.hicache_storage_backend == "dynamic"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert (
        extra["module_path"] == "kvplugins.sglang_hicache_backend" and extra["class_name"] == "KVPluginsHiCacheStorage"
    )
