"""Every command's --help explains each option and shows its default."""

import argparse
import importlib

import pytest

from eyas.common.cli import HelpFormatter

COMMANDS = ["eyas.data.vocab", "eyas.train.cli", "eyas.train.bench", "eyas.serve.cli", "eyas.serve.attention.bench",
            "eyas.serve.linear_bench", "eyas.serve.bench", "eyas.serve.chat", "eyas.serve.evaluate",
            "eyas.serve.profile", "eyas.serve.regenerate"]


class Built(Exception):
    """Raised by parse_args, carrying the command's parser: nothing past parsing runs."""


@pytest.mark.parametrize("module", COMMANDS)
def test_every_option_has_help_and_its_default(module, monkeypatch):
    def capture(self, *args, **kwargs):
        raise Built(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    main = importlib.import_module(module).main
    with pytest.raises(Built) as built:
        main([])
    parser = built.value.args[0]
    assert parser.formatter_class is HelpFormatter
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        assert action.help, f"{module}: {action.option_strings} has no help"
        if action.default not in (None, False, argparse.SUPPRESS):
            shown = HelpFormatter(parser.prog)._get_help_string(action) % {"default": action.default}
            assert "default" in shown and " ".join(shown.split()) in text, (module, action.option_strings)
