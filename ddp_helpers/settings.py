"""Settings as dataclasses: each field has a default and a help text, and becomes a command-line flag.

    @dataclass
    class Config:
        epochs: int = option(10, "passes over the training set")
    cfg = make(Config, check, epochs=3)        # unknown names and bad values: a clear error, at once
    cfg = parse_args(Config, check, argv, prog="python -m ddp_helpers.train", description="...")
"""
import argparse
import dataclasses
import typing


def option(default, help):
    """A dataclass field with its help text (shown by --help)."""
    return dataclasses.field(default=default, metadata={"help": help})


def make(fields, check, **settings):
    """fields(**settings), after refusing unknown names; check(config) returns a list of
    (ok, message) pairs, and the first that is not ok raises ValueError(message)."""
    names = [f.name for f in dataclasses.fields(fields)]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}; the settings are: {', '.join(names)}")
    config = fields(**settings)
    for ok, message in check(config):
        if not ok:
            raise ValueError(message)
    return config


def setting_type(fields, name):
    """The plain type of a field: Optional[int] -> int."""
    kind = typing.get_type_hints(fields)[name]
    return next((a for a in typing.get_args(kind) if a is not type(None)), kind)


def parse_args(fields, check, argv=None, **parser_options):
    """Flags, one per field (--batch-size for batch_size; --flag/--no-flag for booleans), then make()."""
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter, **parser_options)
    for f in dataclasses.fields(fields):
        kind = setting_type(fields, f.name)
        extra = dict(action=argparse.BooleanOptionalAction) if kind is bool else dict(type=kind, metavar=f.name.upper())
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=f.metadata["help"], **extra)
    args = parser.parse_args(argv)
    try:
        return make(fields, check, **vars(args))
    except ValueError as err:
        parser.error(str(err))  # exits with status 2 and the usage line, like argparse's own errors


BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def from_pairs(fields, pairs):
    """["epochs=14", "whiten=false"] -> {"epochs": 14, "whiten": False}, typed as the fields are."""
    names = {f.name for f in dataclasses.fields(fields)}
    out = {}
    for pair in pairs:
        name, _, text = pair.partition("=")
        if name not in names:
            raise ValueError(f"unknown setting {name!r} in {pair!r}")
        kind = setting_type(fields, name)
        if kind is bool:
            if text.lower() not in BOOLEANS:
                raise ValueError(f"{name} is true or false, got {text!r}")
            out[name] = BOOLEANS[text.lower()]
            continue
        try:
            out[name] = kind(text)
        except ValueError:
            raise ValueError(f"{name} takes {kind.__name__} values, got {text!r}") from None
    return out
