"""What `kvplugins up` prints for vLLM works when pasted (issue #31): vLLM's own argument parser reads it as our
connector (embedded.VLLM_FLAGS, the same text flags_text prints)."""

import shlex

from helpers.installed import require

from kvplugins.store.embedded import VLLM_FLAGS, flags_text

require("vllm", "bash ci/install.sh")


def test_vllm_reads_the_printed_flags():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert VLLM_FLAGS in flags_text("127.0.0.1:5555")
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    cfg = parser.parse_args(shlex.split(VLLM_FLAGS)).kv_transfer_config
    assert (cfg.kv_connector, cfg.kv_connector_module_path, cfg.kv_role) == (
        "KVPluginsConnector",
        "kvplugins.vllm_kv_connector",
        "kv_both",
    )
