"""Deterministic multi-turn conversation text (no data set needed): a support chat about a few topics.

``turns(n_turns, seed)`` -> list of (user, assistant) pairs; ``prompt(history, user)`` renders a chat
prompt the way a chat server would: the earlier turns verbatim, then the new user message. Turn k+1's
prompt therefore starts with turn k's whole prompt: the shared prefix that a KV-cache pool serves.
"""

from __future__ import annotations

import random

SUBJECTS = [
    "the cluster",
    "my laptop",
    "the database",
    "our build",
    "the printer",
    "the VPN",
    "the router",
    "the backup job",
    "the web server",
    "the GPU node",
    "the payroll app",
    "the shared drive",
]
VERBS = [
    "crashes",
    "hangs",
    "slows down",
    "reboots",
    "loses data",
    "times out",
    "refuses logins",
    "fills the disk",
    "drops packets",
    "prints garbage",
    "runs hot",
    "forgets settings",
]
WHEN = [
    "every morning",
    "after lunch",
    "under load",
    "on Mondays",
    "after the update",
    "at random",
    "when I open the report",
    "during backups",
    "when two users connect",
    "overnight",
]
ADVICE = [
    "check the logs under /var/log",
    "restart the service and watch the memory",
    "update the firmware",
    "look at the disk usage with df",
    "pin the driver version",
    "increase the timeout to thirty seconds",
    "move the job to a quieter hour",
    "replace the network cable",
    "clear the cache directory",
    "roll back the last change",
    "run the health check script",
    "ask the vendor for a patch",
]
FILLER = [
    "Thanks for the quick answer.",
    "I tried that yesterday.",
    "That is a good point.",
    "Let me give you more detail.",
    "Here is what I see now.",
    "It is still not fixed.",
    "The team is waiting on this.",
    "We also changed the config last week.",
]
SYSTEM = (
    "System: You are a patient support engineer. Answer step by step, name the command to run, and "
    "ask one question at a time.\n"
)


def _sentence(rng: random.Random) -> str:
    return (
        f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(WHEN)}, "
        f"so I think we should {rng.choice(ADVICE)}."
    )


def _message(rng: random.Random, sentences: int) -> str:
    parts = [rng.choice(FILLER)] + [_sentence(rng) for _ in range(sentences)]
    return " ".join(parts)


def turns(n_turns: int, seed: int = 0, sentences: int = 12) -> list[tuple[str, str]]:
    """n_turns (user, assistant) messages of about ``sentences`` sentences each (~17 words a sentence)."""
    rng = random.Random(seed)
    return [(_message(rng, sentences), _message(rng, sentences)) for _ in range(n_turns)]


def prompt(history: list[tuple[str, str]], user: str) -> str:
    """The chat prompt for the next assistant reply after ``history`` and the new ``user`` message."""
    body = "".join(f"User: {u}\nAssistant: {a}\n" for u, a in history)
    return f"{SYSTEM}{body}User: {user}\nAssistant:"


def corpus(seed: int = 12345, n: int = 400) -> list[str]:
    """Training text for the demo tokenizer: every word the conversations can use, many times."""
    words = " ".join(SUBJECTS + VERBS + WHEN + ADVICE + FILLER) + " User: Assistant: " + SYSTEM
    rng = random.Random(seed)
    return [words] + [_message(rng, 6) for _ in range(n)]
