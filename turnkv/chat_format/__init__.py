"""What knows a chat format: tool-call formats and their parser (``toolcalls``), grammars compiled
from a request (``grammar``, with ``schema_check``, ``grammar_probe`` and ``pattern_size``), the
answer's structure a request asks for (``structured``) and the history a turn re-renders
(``history``). The engine sees none of it: a turn's grammar is an ``engine.masks.TurnGrammar``."""
