"""Constrained decoding: output formats (JSON schemas, regexes, Lark grammars) compiled with
llguidance into token masks. A leaf below the model and the request sides."""
