"""The conversations ``bench/speculation.py`` times: edit-style, list revision and free text.

A conversation is a first user message and, for revisions of the model's own answer, a follow-up:
the bench generates the first answer once (greedy, speculation off, untimed) and times the
follow-up turn, whose prompt then holds the whole history -- the multi-turn case context copy is
for. Single-turn edits paste the text to revise into the prompt. SmolLM2-135M (the default model)
falls into repeating loops on many prompts, which would flatter speculation; these were picked
because its answers to them end cleanly (a few lines of a loop remain in ``email-day``).
"""

from __future__ import annotations

from dataclasses import dataclass

_EMAIL = """Hi Anna,

Thanks for sending the report. I read it over the weekend and I think the numbers look good. \
Could we meet on Monday at 10am to go through the budget section? I will bring the printed copies \
and the notes from last week.

Best regards,
Tom"""
_PACKING = ["Passport", "Phone charger", "Toothbrush", "Sunscreen", "Rain jacket", "Hiking boots",
            "Water bottle", "First aid kit", "Headlamp", "Notebook", "Snacks", "Sunglasses"]  # fmt: skip
_TODO = ["Call the bank", "Buy groceries", "Pay the electricity bill", "Book a dentist appointment",
         "Return library books", "Water the plants", "Send the invoice to Mark", "Clean the garage"]  # fmt: skip


@dataclass(frozen=True)
class Conversation:
    name: str
    kind: str  # edit | list | free
    first: str
    follow_up: str | None = None  # asked after the model's own answer to ``first``


def _listing(items: list[str]) -> str:
    return "\n".join(f"{i + 1}. {x}" for i, x in enumerate(items))


CONVERSATIONS = [
    Conversation("csv-rename", "edit",
                 "Write a Python function that reads a CSV file and returns the sum of the `amount` column.",
                 "Show the same code again, but call the function `total_amount`."),
    Conversation("email-day", "edit", "Write a short email to Anna asking to move our meeting to Monday.",
                 "Repeat the email exactly, but change Monday to Friday."),
    Conversation("email-paste", "edit",
                 f"Copy this email, but change the day from Monday to Tuesday:\n\n{_EMAIL}"),
    Conversation("fibonacci-rename", "edit",
                 "Write a Python function that returns the n-th Fibonacci number.",
                 "Show the same code again, but call the function `fib`."),
    Conversation("packing-swap", "list",
                 f"Here is my packing list:\n\n{_listing(_PACKING)}\n\nRewrite the full list with one "
                 'change: replace item 9 with "Power bank". Keep every other item exactly as it is.'),
    Conversation("todo-swap", "list",
                 f"My to-do list:\n\n{_listing(_TODO)}\n\nRewrite the whole list, but replace item 4 "
                 'with "Renew my passport".'),
    Conversation("cooking-tips", "list", "Write a numbered list of 8 tips for learning to cook.",
                 "Rewrite the same list, but replace tip 3 with a tip about knife safety."),
    Conversation("lighthouse", "free",
                 "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    Conversation("robot", "free", "Write a short story about a robot learning to paint."),
    Conversation("rainbows", "free", "Explain how rainbows form, for a ten-year-old."),
]  # fmt: skip

# eight turns of one step: three edits, three lists, two free texts
BATCH_8 = ["csv-rename", "email-day", "email-paste", "packing-swap", "todo-swap", "cooking-tips",
           "lighthouse", "robot"]  # fmt: skip


def of_kind(kind: str) -> list[Conversation]:
    out = [c for c in CONVERSATIONS if c.kind == kind]
    if not out:
        raise ValueError(f"unknown prompt kind {kind!r} (edit, list, free)")
    return out


def by_name(names: list[str]) -> list[Conversation]:
    table = {c.name: c for c in CONVERSATIONS}
    return [table[n] for n in names]
