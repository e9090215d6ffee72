"""What every eyas command line shares."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with each option's default: the description and epilog as written (their examples keep their lines),
    and "(default: X)" after an option's help where it has a value and the help does not already say what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS) and action.option_strings
        return f"{text} (default: %(default)s)".lstrip() if shown and "default" not in text else text
