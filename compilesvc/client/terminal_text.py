"""Compiler output as text a terminal prints and a browser shows as it is: what ``compilesvc logs``, ``submit
--logs`` and the UI do to a log line before showing it.

A compile log is written by the compile (the tenant's model and flags reach the compiler), so a line may carry
terminal control sequences: an OSC 52 clipboard write (``ESC ] 52 ; c ; <base64> BEL``, xterm's "Manipulate
Selection Data", ctlseqs), cursor moves or a ``\\r`` that overwrites what a reader sees with a forged line
(``[compile-child] ok``), a title change, a hyperlink. :func:`visible` makes every C0 control other than tab and
newline, DEL, and every C1 control (U+0080-U+009F: a UTF-8 terminal may take U+009B as CSI) into its ``\\xNN`` text,
so an escape sequence loses its ESC (or CSI) and prints as the characters it was made of. Nothing else changes; a
literal backslash stays as it is (the transformation is for reading, not for round trips: ``--raw`` gives the
bytes as logged).
"""

from __future__ import annotations

import re

#: C0 controls but tab (0x09) and newline (0x0A), DEL, and the C1 controls.
CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(line: str) -> str:
    """``line`` with each control character (see :data:`CONTROLS`) written as ``\\xNN``."""
    return CONTROLS.sub(lambda match: f"\\x{ord(match.group()):02x}", line)
