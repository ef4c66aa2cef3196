"""What every benchmark records beside its figures, and a port for the servers it starts.

``cpu_model()`` names the CPU as /proc/cpuinfo does, with its family and model numbers: the Intel VMs here all
report "Intel(R) Xeon(R) Processor", and only the numbers tell Ice Lake (family 6 model 106) from Emerald Rapids
(model 207). Imported as ``machine`` by scripts run from this directory (their own directory is on sys.path)."""

from __future__ import annotations

import platform
import socket


def cpu_model() -> str:
    """ "<model name> (family F model M)" of the first CPU in /proc/cpuinfo; platform.processor() elsewhere."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        return platform.processor() or platform.machine()
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')})"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (for servers that cannot bind port 0 and report it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
