"""Key remapping (Burn's KeyRemapper), contiguous indices, filters and their inverse (syncd/adapters/keys.py)."""

from __future__ import annotations

import pytest

from syncd.adapters.keys import (
    NameCollisionError,
    TensorFilter,
    compile_rule,
    contiguous_indices,
    invert,
    parse_rule_argument,
    rename_all,
    renames,
)


def rules(*pairs: tuple[str, str]):
    return [compile_rule(p, r) for p, r in pairs]


def test_rules_apply_in_order_to_the_name_as_left_by_the_previous_ones() -> None:
    # Burn's own examples (keyremapper.rs): each rule sees the result of the ones before
    mapped = rename_all(
        ["encoder.layer1.gamma", "decoder.layer1.weight"],
        rules((r"^encoder\.", "transformer.encoder."), (r"\.gamma$", ".weight")),
    )
    assert mapped == {
        "encoder.layer1.gamma": "transformer.encoder.layer1.weight",
        "decoder.layer1.weight": "decoder.layer1.weight",
    }
    chained = rename_all(["a.b"], rules((r"a", "x"), (r"x", "y")))
    assert chained == {"a.b": "y.b"}


def test_replace_all_matches() -> None:
    assert rename_all(["a.a.a"], rules((r"a", "b")))["a.a.a"] == "b.b.b"


@pytest.mark.parametrize(
    ("pattern", "replacement", "name", "expected"),
    [
        (r"^model\.layers\.(\d+)\.", "blocks.$1.", "model.layers.12.mlp.weight", "blocks.12.mlp.weight"),
        (r"^model\.layers\.(\d+)\.", "blocks.${1}.", "model.layers.3.x", "blocks.3.x"),
        (r"^(?P<head>\w+)\.w$", "${head}.weight", "fc.w", "fc.weight"),
        (r"^(?P<head>\w+)\.w$", "$head.weight", "fc.w", "fc.weight"),
        (r"^(\w+)\.(\w+)$", "$2.$1", "a.b", "b.a"),
        (r"^(\w+)$", "$$1", "a", "$1"),
        (r"^(\w+)$", "cost$", "a", "cost$"),
        (r"^(\w+)$", "${1}x", "a", "ax"),
        (r"^(\w+)$", r"\1", "a", r"\1"),  # a backslash is literal in Rust's replacement syntax
        (r"b", "$0$0", "abc", "abbc"),
        (r"^(a)?b", "[$1]", "b", "[]"),  # a group that did not take part gives nothing
    ],
)
def test_rust_replacement_syntax(pattern: str, replacement: str, name: str, expected: str) -> None:
    assert compile_rule(pattern, replacement).apply(name) == expected


@pytest.mark.parametrize(
    ("pattern", "replacement", "message"),
    [
        ("(", "x", "does not compile"),
        (r"^(\d+)", "$2", r"names group \$2, but pattern '\^\(\\d\+\)' has 1 group$"),
        (r"^(\d+)", "$1x", r"write \$\{1\}x"),
        (r"^(\d+)", "${name}", "names group \\$name"),
    ],
)
def test_bad_rules_are_refused_in_one_line(pattern: str, replacement: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        compile_rule(pattern, replacement)
    assert "\n" not in str(info.value)


def test_rule_argument() -> None:
    rule = parse_rule_argument(r"^model\.=m.")
    assert (rule.pattern, rule.replacement) == (r"^model\.", "m.")
    assert parse_rule_argument("x=").apply("x.y") == ".y"
    for bad in ("nothing", "=x"):
        with pytest.raises(ValueError, match="PATTERN=REPLACEMENT"):
            parse_rule_argument(bad)


def test_collision_names_both_sources() -> None:
    with pytest.raises(NameCollisionError, match="'a.weight' and 'b.weight' would both be named 'x.weight'"):
        rename_all(["a.weight", "b.weight", "c.bias"], rules((r"^[ab]\.", "x.")))


# Burn's own cases for map_indices_contiguous (keyremapper.rs tests)
def test_contiguous_indices_basic() -> None:
    names = ["fc.0.weight", "fc.0.bias", "fc.2.weight", "fc.2.bias", "fc.4.weight", "fc.4.bias"]
    assert list(contiguous_indices(names).values()) == [
        "fc.0.weight",
        "fc.0.bias",
        "fc.1.weight",
        "fc.1.bias",
        "fc.2.weight",
        "fc.2.bias",
    ]


def test_contiguous_indices_independent_prefixes_and_nesting() -> None:
    names = ["encoder.0.weight", "encoder.2.weight", "decoder.1.weight", "decoder.5.weight"]
    assert list(contiguous_indices(names).values()) == [
        "encoder.0.weight",
        "encoder.1.weight",
        "decoder.0.weight",
        "decoder.1.weight",
    ]
    nested = [
        "feature.layers.0.conv_block.0.weight",
        "feature.layers.0.conv_block.2.weight",
        "feature.layers.2.conv_block.0.weight",
        "feature.layers.2.conv_block.2.weight",
    ]
    assert list(contiguous_indices(nested).values()) == [
        "feature.layers.0.conv_block.0.weight",
        "feature.layers.0.conv_block.1.weight",
        "feature.layers.1.conv_block.0.weight",
        "feature.layers.1.conv_block.1.weight",
    ]
    # indices are compared as numbers (10 after 9), and a leading index has the empty prefix
    assert contiguous_indices(["3.a", "10.a", "9.a"]) == {"3.a": "0.a", "10.a": "2.a", "9.a": "1.a"}


def test_contiguous_after_the_rules_and_renames_carried_for_the_way_back() -> None:
    names = ["features.0.weight", "features.3.weight", "classifier.1.bias"]
    mapped = rename_all(names, rules((r"^features\.", "conv.")), contiguous=True)
    assert mapped == {
        "features.0.weight": "conv.0.weight",
        "features.3.weight": "conv.1.weight",
        "classifier.1.bias": "classifier.0.bias",
    }
    carried = renames(mapped)
    assert carried == {
        "conv.0.weight": "features.0.weight",
        "conv.1.weight": "features.3.weight",
        "classifier.0.bias": "classifier.1.bias",
    }
    assert invert(mapped.values(), carried) == {new: old for old, new in mapped.items()}


def test_contiguous_collision_of_two_spellings_is_refused() -> None:
    with pytest.raises(NameCollisionError, match="'fc.01.w' and 'fc.1.w'"):
        rename_all(["fc.01.w", "fc.1.w"], [], contiguous=True)


def test_invert_refuses_restoring_onto_an_existing_name() -> None:
    with pytest.raises(NameCollisionError, match="would both be named 'a'"):
        invert(["a", "b"], {"b": "a"})


def test_filter_semantics() -> None:
    names = ["model.layers.0.mlp.w", "model.layers.1.mlp.w", "lm_head.weight", "model.norm.weight"]
    assert TensorFilter.of().split(names) == (names, [])
    assert TensorFilter.of(include=[r"layers\.0"]).split(names) == (["model.layers.0.mlp.w"], names[1:])
    # unanchored search, as PathFilter::with_regex; exclude wins over include
    kept, left = TensorFilter.of(include=["mlp", "norm"], exclude=[r"^model\.layers\.1\."]).split(names)
    assert kept == ["model.layers.0.mlp.w", "model.norm.weight"]
    assert left == ["model.layers.1.mlp.w", "lm_head.weight"]
    with pytest.raises(ValueError, match="does not compile"):
        TensorFilter.of(exclude=["[unclosed"])
