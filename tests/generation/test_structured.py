"""Structured output on the llm engine: the real ferry-sidecar decoding SmolLM2-135M-Instruct under
OpenAI's response_format and vLLM's guided_* fields, driven by OpenAI's own Python client.

Whether an answer keeps to its format is judged here, independently of the library that made the
masks: answers are parsed with Python's json and validated with the jsonschema package against the
very schema sent, regexes matched with Python's re."""

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from jsonschema import Draft202012Validator

from generation_sidecar import MODEL, Sidecar
from test_llm import gguf

WORDS = ["name", "city", "age", "color", "size", "tags", "owner", "price", "count", "active", "kind", "notes"]
NOUNS = ["a cat", "a city", "a book", "a car", "a planet", "a recipe", "a song", "a tree", "a shop", "a river"]


@pytest.fixture(scope="module")
def sidecar():
    s = Sidecar(engine="llm", model_source=gguf(), device="cpu", max_sequences=16, max_batch_tokens=512)
    yield s
    s.stop()


def random_value(rng, depth):
    """A schema for one value: strings (bounded, sometimes patterned), bounded integers and
    numbers, booleans, enums, arrays and nested objects."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        if rng.random() < 0.2:
            return {"type": "string", "pattern": "^[a-z]{2,6}$"}
        return {"type": "string", "minLength": rng.choice([0, 1]), "maxLength": rng.randint(4, 16)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 1000)}
    if kind == "number":
        # JSON's numbers have no bound on their digits: at multiples of a hundredth a greedy small
        # model cannot write zeros after the point until its token limit (as it can without).
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100, 10000]), "multipleOf": 0.01}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", 1, 2, True, None], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_value(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return random_object(rng, depth + 1)


def random_object(rng, depth=0):
    names = rng.sample(WORDS, rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {n: random_value(rng, depth) for n in names},
        "required": sorted(rng.sample(names, rng.randint(1, len(names)))),
        "additionalProperties": False,
    }


def ask(sidecar, i, schema):
    answer = sidecar.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Describe {NOUNS[i % len(NOUNS)]} as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}},
        max_tokens=400,
        temperature=[0.0, 0.8][i % 2],
        seed=i,
    )
    return answer.choices[0]


def test_fifty_random_schemas_are_each_answered_with_a_valid_value(sidecar):
    rng = random.Random(2026)
    schemas = [random_object(rng) for _ in range(50)]
    assert sum("object" in json.dumps(s["properties"]) for s in schemas) > 10, "nested objects among them"
    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(lambda a: ask(sidecar, *a), enumerate(schemas)))
    for i, (schema, choice) in enumerate(zip(schemas, choices)):
        assert choice.finish_reason == "stop", (i, schema, choice.message.content)
        value = json.loads(choice.message.content)
        errors = list(Draft202012Validator(schema).iter_errors(value))
        assert not errors, (i, schema, value, errors[0].message)
    # The model's own answers, not one value: most differ.
    assert len({c.message.content for c in choices}) > 40


def test_json_object_mode_answers_an_object_and_streams_the_same(sidecar):
    asked = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with a JSON object holding the name and age of a person."}],
        response_format={"type": "json_object"},
        max_tokens=300,
        temperature=0,
    )
    whole = sidecar.client.chat.completions.create(**asked).choices[0]
    assert whole.finish_reason == "stop", whole.message.content
    assert isinstance(json.loads(whole.message.content), dict)
    streamed = "".join(c.choices[0].delta.content or "" for c in sidecar.client.chat.completions.create(**asked, stream=True) if c.choices)
    assert streamed == whole.message.content


def test_vllms_guided_regex_choice_and_grammar(sidecar):
    def answer(extra, ask="Answer briefly.", **kw):
        return sidecar.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ask}], max_tokens=40, extra_body=extra, **kw
        ).choices[0]

    for seed in range(4):
        c = answer({"guided_regex": r"[A-Z][a-z]{2,8} [0-9]{1,3}"}, "Name a street and a number.", seed=seed, temperature=1)
        assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", c.message.content), c.message.content
        choices = ["positive", "negative", "it is \"neutral\""]
        c = answer({"guided_choice": choices}, "Is 'I love it' positive or negative?", seed=seed, temperature=1)
        assert c.message.content in choices and c.finish_reason == "stop", c.message.content
    grammar = 'start: "SELECT " COLUMN " FROM " TABLE ";"\nCOLUMN: /[a-z]+/\nTABLE: "users" | "orders"'
    c = answer({"guided_grammar": grammar}, "Write an SQL query.", temperature=0)
    assert re.fullmatch(r"SELECT [a-z]+ FROM (users|orders);", c.message.content), c.message.content
    # vLLM's newer spelling, on a completion.
    c = sidecar.client.completions.create(
        model=MODEL, prompt="The answer is", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    ).choices[0]
    assert c.text in ("yes", "no"), c.text


def test_n_choices_each_keep_to_the_schema(sidecar):
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 10}}, "required": ["word"],
              "additionalProperties": False}
    answer = sidecar.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say a word as JSON."}], n=3, temperature=1, seed=3,
        max_tokens=50, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
    )
    values = [json.loads(c.message.content) for c in answer.choices]
    for v in values:
        Draft202012Validator(schema).validate(v)
    assert len({json.dumps(v) for v in values}) > 1, "three draws, each its own place in the schema"


def test_formats_that_cannot_be_followed_are_a_400_naming_the_field(sidecar):
    def refused(**kw):
        with pytest.raises(openai.BadRequestError) as e:
            sidecar.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=5, **kw
            )
        return e.value.message

    m = refused(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert "'response_format' is" in m and "nope" in m, m
    assert "'guided_regex' is" in refused(extra_body={"guided_regex": "[a-"})
    assert "both ask for a structured output" in refused(
        response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}
    )
    assert "its type must be" in refused(response_format={"type": "xml"})
    # A refusal loses nothing: the next request is served.
    ok = sidecar.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=3, response_format={"type": "json_object"}
    )
    assert ok.choices[0].message.content.startswith("{")
