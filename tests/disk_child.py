"""A child process for the restart and kill -9 tests: the tiny engine and a bank over a directory.

    python tests/disk_child.py DIR once          # one turn of conversation 0, close cleanly, print its ids
    python tests/disk_child.py DIR forever SEED  # turns of six conversations, round after round, until killed

``once`` prints ``ready`` when the engine is built; ``forever`` after its first turn was banked (so
its blocks are being written when the parent kills it). Each SEED starts other conversations.
"""

from __future__ import annotations

import json
import sys

from disk_helpers import bank_over, prompt, tiny_engine, turn


def conversation(i: int) -> list[int]:
    """The prompt of conversation ``i`` (the parent rebuilds the same ids)."""
    return prompt(300 + (i * 211) % 900, seed=i)


def main(directory: str, mode: str, seed: int = 0) -> None:
    engine = tiny_engine()
    bank = bank_over(engine, directory)
    if mode == "once":
        print("ready", flush=True)
        turn(engine, bank, "ns", conversation(0))
        bank.tier.close()
        [entry] = bank.entries()
        print(json.dumps(list(entry.tokens)), flush=True)
        return
    histories = {i: conversation(100 * seed + i) for i in range(6)}
    ready = False
    while True:  # every conversation grows by an answer and a new message each round
        for i, ids in histories.items():
            out = turn(engine, bank, "ns", ids, max_tokens=3)[0]
            histories[i] = [*ids, *out, *prompt(97, seed=1000 + len(ids))]
            if not ready:
                print("ready", flush=True)
                ready = True


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
