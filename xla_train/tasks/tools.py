"""Tools in GRPO's rollouts (`--tools`): TRL 1.16's GRPOTrainer tool loop (trainer/grpo_trainer.py,
`_tool_call_loop`), with the rollout's static shapes.

    --tools tests/tool_task.py:multiply       a function in a file (repeat the flag for several)
    --tools mypackage.tools:search            a function in an importable module
    --max-tool-calling-iterations 2           tool turns a completion may take (TRL's default: no limit)

A tool is a function with type hints and a Google-style docstring (transformers' `get_json_schema`
describes it to the chat template, which renders the prompts with `tools=`); an async one is awaited.
A rollout (`ToolLoop`):

    generate    every row's turn, in the rollout's preallocated cache (kernels/generate.py `Turns`)
    parse       on the host (the turn's one transfer): each row's new turn through transformers'
                `parse_response` and the tokenizer's response template (TRL's `add_response_schema`
                sets one for known families); a malformed call stays text (TRL's parse_response)
    run         each call on the host; a tool that raises, or a call to no known tool, gives
                {"error": ...} as its result and counts as a failure, as TRL's
    append      the results rendered as the chat template's tool turn (TRL's `_get_tool_suffix_ids`),
                written after the row's turn; generation resumes for those rows only

until no row calls a tool or each has taken --max-tool-calling-iterations tool turns. A row keeps
--max-completion-length tokens after its prompt, tool results included, as TRL 1.16 counts them: a
result that would not fit is dropped and the row ends with its turn (TRL's rollback), and the next
turn stops at the budget. The tool results' tokens are out of the loss (TRL's tool_mask); the
reward functions get each completion as its list of turns (the assistant's, with its `tool_calls`,
and the tools'), TRL's form.

    --environment tests/tool_task.py:Ledger   TRL's environment_factory (one callable): a class, or a
                                              function that makes one, in a file or a module
    --environment game=games.py:Game --environment shell=mypkg.envs:Shell
                                              TRL's dict of them: each row names its own in an
                                              `environment` column

An environment (`Environments`, TRL 1.16's GRPOTrainer with `environment_factory`) is made once per
completion of a rollout, kept in a pool across steps and reset before each rollout with its row's
columns (`reset(**row)`); text that `reset` returns is appended to the row's last message, and the
prompt is rendered again (left-padded to --max-length where shapes are static). Its public methods
(but `reset` and `get_reward`) are tools bound to it, beside --tools', and described to the chat
template the same way; a `get_reward()` is one more reward (weight 1, named after the class), with
which --reward may be left out. Reward functions get the instances as `environments`, as TRL's.
With several named, each row's `environment` column chooses its own: its prompt is rendered with
that environment's tools only, and a class's get_reward scores its own rows (None for the others).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..core.errors import UserError, first_line
from .documents import check_tools_rendered
from .rewards import find

TOOL_METRICS = ("tools/call_frequency", "tools/failure_frequency")
ENVIRONMENT_REWARD = f"{__name__}:environment_reward"  # --environment's get_reward, as a reward function
ENVIRONMENT_COLUMN = "environment"  # TRL's: the column that names each row's environment (several named)


def specs_of(tools: str | None) -> tuple[str, ...]:
    """--tools' functions (comma-separated, or repeated flags)."""
    return tuple(s.strip() for s in (tools or "").split(",") if s.strip())


def describe(function: Any, label: str) -> dict:
    """A tool's JSON schema as the chat template gets it (transformers' `get_json_schema`), or one
    line saying why it cannot be described (`label`: the tool as the user named it)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as e:  # transformers' TypeHintParsingException / DocstringParsingException, or the user's
        raise UserError(f"{label}: the chat template cannot be told about it ({first_line(e)}); a tool "
                        "needs type hints and a Google-style docstring with an Args: section") from None


_PROBED: dict[tuple[str | None, str], Any] = {}  # each environment's first instance, by its name and spec


def class_of(instance: Any) -> str:
    """An environment's class, told apart from another of the same name: module.qualname."""
    return f"{type(instance).__module__}.{type(instance).__qualname__}"


def methods_of(environment: Any) -> list[Any]:
    """An environment's tools, TRL's rule: its class's public functions but `reset` and
    `get_reward`, bound to it."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def factories_of(option: str | None) -> dict[str | None, str]:
    """--environment's factories by name: {None: spec} for one (TRL's callable), {name: spec} for
    NAME=spec, one or several (TRL's dict; rows choose theirs in the `environment` column)."""
    specs = specs_of(option)
    if len(specs) == 1 and "=" not in specs[0]:
        return {None: specs[0]}
    out: dict[str | None, str] = {}
    for spec in specs:
        name, eq, factory = (x.strip() for x in spec.partition("="))
        if not eq or not name or not factory:
            raise UserError(f"--environment {spec}: with several environments, name each NAME=module:Class (each "
                            f"row names its own in an '{ENVIRONMENT_COLUMN}' column, as TRL's dict of them)")
        if name in out:
            raise UserError(f"--environment: {name!r} is named twice")
        out[name] = factory
    return out


@dataclass(frozen=True)
class Toolbox:
    """The --tools functions, by name, with their schemas, and --environment's methods."""

    specs: tuple[str, ...]
    environment: str | None = None  # --environment: TRL's environment_factory (or NAME=..., several)

    @cached_property
    def factories(self) -> dict[str | None, str]:
        return factories_of(self.environment)

    @property
    def named(self) -> bool:
        """Several environments by name (TRL's dict): each row names its own."""
        return any(name is not None for name in self.factories)

    @cached_property
    def probes(self) -> dict[str | None, Any]:
        """Each environment's first instance, made now and checked (TRL probes one as its trainer
        starts; once a process): its pool's first (`Environments`)."""
        out = {}
        for name, spec in self.factories.items():
            if (name, spec) not in _PROBED:  # one factory under two names: two pools (TRL calls it per name)
                instance = made(spec)
                if not callable(getattr(instance, "reset", None)):
                    raise UserError(f"--environment {spec}: {type(instance).__name__} has no reset method; an "
                                    "environment resets itself before each rollout (TRL's environment_factory)")
                if not methods_of(instance):
                    raise UserError(f"--environment {spec}: {type(instance).__name__} has no public methods, "
                                    "which would be its tools (all but reset and get_reward)")
                _PROBED[name, spec] = instance
            out[name] = _PROBED[name, spec]
        return out

    @cached_property
    def own_schemas(self) -> list[dict]:
        return [describe(find(s, "--tools"), f"--tools {s}") for s in self.specs]

    def environment_of(self, row: dict, where: str) -> str | None:
        """The environment a row names in its `environment` column where several are named (TRL's
        dict), checked (`where`: the row, for the message); None where there is one or none."""
        if not self.named:
            return None
        name = row.get(ENVIRONMENT_COLUMN)
        if not isinstance(name, str) or name not in self.factories:
            raise UserError(f"{where}: '{ENVIRONMENT_COLUMN}' must name one of --environment's "
                            f"({', '.join(str(n) for n in self.factories)}), as TRL's dict of them; found {name!r}")
        return name

    def schemas_of(self, row: dict, where: str) -> list[dict]:
        """The schemas a row's prompt is rendered with (its environment's, `environment_of`)."""
        return self.schemas_for(self.environment_of(row, where))

    def schemas_for(self, name: str | None = None) -> list[dict]:
        """The schemas a row's prompt is rendered with: --tools' and its environment's methods'
        (`name`: the row's, None where there is one or none)."""
        probe = self.probes.get(name)
        if probe is None:
            return self.own_schemas
        return self.own_schemas + [describe(m, f"--environment {self.factories[name]}: its method {m.__name__}")
                                   for m in methods_of(probe)]

    @cached_property
    def schemas(self) -> list[dict]:
        """Every tool's schema, each once: what the chat template is checked with."""
        out: list[dict] = []
        for name in self.factories or [None]:
            out += [s for s in self.schemas_for(name) if s not in out]
        return out

    @cached_property
    def functions(self) -> dict[str, Any]:
        """The --tools functions by name (an environment's are its instances', `functions_of`)."""
        return {schema["function"]["name"]: find(spec, "--tools") for spec, schema in zip(self.specs, self.own_schemas)}

    def functions_of(self, environment: Any = None) -> dict[str, Any]:
        """The tools a row's calls may run: --tools' and its environment's methods."""
        if environment is None:
            return self.functions
        return {**self.functions, **{m.__name__: m for m in methods_of(environment)}}

    @property
    def rewarded(self) -> dict[str, tuple[str, str]]:
        """{class (`class_of`): (its name in the metrics, a factory)} of the environments that own a
        reward (`get_reward`, TRL's), each class once: its `__name__`, numbered where two share it."""
        out: dict[str, tuple[str, str]] = {}
        for name, probe in self.probes.items():
            if callable(getattr(probe, "get_reward", None)) and class_of(probe) not in out:
                label = type(probe).__name__
                taken = [shown for shown, _ in out.values()]
                out[class_of(probe)] = (label if label not in taken else f"{label}_{len(taken) + 1}",
                                        self.factories[name])
        return out

    def check(self, tokenizer: Any) -> None:
        """The chat template renders a whole exchange with a call and a result (TRL's
        `supports_tool_calling`, trl/chat_template_utils.py) and the tools in the prompt, and the
        tokenizer can parse calls (a response template: its own, or TRL's for a known family)."""
        sentinels = ("tool_name_a8f3", "arg_key_b9d4", "arg_val_d6e7", "content_c4f9")
        call = {"type": "function", "function": {"name": sentinels[0], "arguments": {sentinels[1]: sentinels[2]}}}
        exchange = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": sentinels[0], "content": sentinels[3]}]
        try:
            text = tokenizer.apply_chat_template(exchange, tools=self.schemas, tokenize=False)
        except Exception as e:  # jinja's TemplateError and what a template raises itself
            raise UserError(f"--tools: the chat template cannot render tool calls ({first_line(e)})") from None
        check_tools_rendered(text, exchange, self.schemas, "--tools")  # the traces' rule
        with_response_template(tokenizer)


def with_response_template(tokenizer: Any) -> None:
    """Sets the tokenizer's response template (what `parse_response` reads) where it has none,
    from TRL's `add_response_schema` for the families it knows (trl/chat_template_utils.py);
    TRL is needed only then."""
    if getattr(tokenizer, "response_template", None) is not None:
        return
    try:
        from trl.chat_template_utils import add_response_schema
    except ImportError:
        raise UserError("--tools: the tokenizer has no response_template to parse tool calls with; install TRL "
                        "(pip install 'xla-train[agents]'), whose add_response_schema knows the common families, "
                        "or set response_template in the tokenizer's tokenizer_config.json") from None
    try:
        add_response_schema(tokenizer)
    except ValueError:
        raise UserError("--tools: the tokenizer has no response_template to parse tool calls with, and TRL's "
                        "add_response_schema does not know its chat template; set response_template in its "
                        "tokenizer_config.json (transformers' chat response parsing docs)") from None


def parse(tokenizer: Any, ids: list[int], prefix: list[int], schemas: list[dict]) -> dict:
    """A generated turn as a message, TRL 1.16's `parse_response` (trl/chat_template_utils.py):
    transformers' `parse_response` with the prompt before it and the tools' schemas; anything it
    cannot parse (a malformed call) is the turn's text."""
    try:
        parsed = tokenizer.parse_response(ids, prefix=prefix, tools=schemas)
        if parsed is None:
            raise ValueError("nothing parsed")
        content = parsed.get("content")
        if isinstance(content, str) and tokenizer.eos_token:
            parsed["content"] = content.removesuffix(tokenizer.eos_token)  # TRL's hotfix (transformers#42249)
        parsed["content"] = parsed.get("content") or ""
        _check_calls(parsed.get("tool_calls"))
    except (ValueError, TypeError):
        parsed = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return parsed


def _check_calls(calls: Any) -> None:
    """TRL's `_validate_tool_calls`: every call names a function; missing arguments are none."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("a tool call without a name")
        if function.get("arguments") is None:
            function["arguments"] = {}


@dataclass
class Calls:
    """The tool calls of a rollout: how many were made, how many failed."""

    made: int = 0
    failed: int = 0

    def run(self, calls: list[dict], functions: dict[str, Any]) -> list[dict]:
        """Each call's result as a tool turn; a raising tool's error is its result (a failure)."""
        out = []
        for call in calls:
            self.made += 1
            function = call.get("function", call)
            name = function.get("name", "unknown")
            try:
                if call.get("type", "function") != "function":
                    raise ValueError(f"Unsupported tool call type: {call.get('type')}")
                if name not in functions:
                    raise ValueError(f"Tool {name} not found.")
                arguments = function.get("arguments") or {}
                if isinstance(arguments, str):
                    arguments = json.loads(arguments)
                result = functions[name](**arguments)
                if inspect.isawaitable(result):
                    result = asyncio.run(_awaited(result))
            except Exception as e:  # the user's tool: any error is its result, as TRL's
                self.failed += 1
                result = {"error": str(e)}
            out.append({"role": "tool", "name": name, "content": str(result)})
        return out

    def frequencies(self, completions: int) -> list[float]:
        """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed calls per call)."""
        return [self.made / max(completions, 1), self.failed / self.made if self.made else 0.0]


async def _awaited(value: Any) -> Any:
    return await value


def made(spec: str) -> Any:
    """One environment from --environment's factory (a class, or a function making one)."""
    factory = find(spec, "--environment")
    try:
        return factory()
    except Exception as e:  # the user's factory
        raise UserError(f"--environment {spec}: making one raised {type(e).__name__}: {first_line(e)}") from None


class Environments:
    """--environment's instances, TRL's pool: one per completion of a rollout, made once (each
    environment's pool grows to the most of its rows a rollout holds) and reset before each
    rollout with its row's columns."""

    def __init__(self, toolbox: Toolbox) -> None:
        self.toolbox = toolbox
        self.pools = {name: [probe] for name, probe in toolbox.probes.items()}

    def reset(self, rows: list[dict]) -> tuple[list[Any], list[str | None]]:
        """The rollout's instances (one per row, in order) and what each reset returned: text to
        append to its row's last message, or None. `rows`: the completions' rows' columns, each
        with `_where` (the row, for messages), which reset does not get (nor, with several
        environments, the `environment` column, as TRL's)."""
        instances, observations, taken = [], [], dict.fromkeys(self.pools, 0)
        for row in rows:
            name = self.toolbox.environment_of(row, row["_where"])
            spec, pool = self.toolbox.factories[name], self.pools[name]
            if taken[name] == len(pool):
                pool.append(made(spec))
            instance = pool[taken[name]]
            taken[name] += 1
            columns = {k: v for k, v in row.items() if k != "_where" and not (self.toolbox.named and
                                                                                k == ENVIRONMENT_COLUMN)}
            try:
                observation = instance.reset(**columns)
            except Exception as e:  # the user's environment
                raise UserError(f"--environment {spec}: reset raised {type(e).__name__}: {first_line(e)} "
                                f"({row['_where']})") from None
            if observation is not None and not isinstance(observation, str):
                raise UserError(f"--environment {spec}: reset returned {type(observation).__name__} for "
                                f"{row['_where']}; text (appended to the prompt) or None is needed")
            instances.append(instance)
            observations.append(observation)
        return instances, observations


def observed(prompt: list[dict], observation: str | None) -> list[dict]:
    """A chat prompt with what its environment's reset returned appended to its last message, as
    TRL appends it (the row's own prompt is left as it was)."""
    if observation is None:
        return prompt
    return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]


def environment_reward(completions: list, environments: list | None = None, owner: str = "",
                       **kwargs: Any) -> list:
    """The reward an environment owns: each completion's instance's `get_reward()` (TRL's, sync or
    async), read after the rollout; None for a row of another class than `owner` (`class_of`), as
    TRL matches the exact type."""
    assert environments is not None and len(environments) == len(completions)
    try:
        values = [e.get_reward() if class_of(e) == owner else None for e in environments]
        if any(inspect.isawaitable(v) for v in values):
            values = asyncio.run(_gathered(values))
    except Exception as e:  # the user's environment
        raise UserError(f"--environment: {owner.rpartition('.')[2]}.get_reward raised {type(e).__name__}: "
                        f"{first_line(e)}") from None
    return values


async def _gathered(values: list) -> list:
    return [await v if inspect.isawaitable(v) else v for v in values]


def suffix_ids(tokenizer: Any, results: list[dict]) -> list[int]:
    """The tokens that follow a turn's end to hold its tool results and open the next assistant
    turn, TRL 1.16's `_get_tool_suffix_ids`: a one-call exchange rendered with and without them,
    the first cut after its last end-of-sequence token."""
    call = [{"type": "function", "function": {"name": results[0]["name"], "arguments": {}}}]
    exchange = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
    before = tokenizer.apply_chat_template(exchange, tokenize=True, return_dict=False)
    after = tokenizer.apply_chat_template(exchange + results, tokenize=True, return_dict=False,
                                          add_generation_prompt=True)
    ends = [i for i, t in enumerate(before) if t == tokenizer.eos_token_id]
    before = before[:ends[-1] + 1] if ends else before
    if after[:len(before)] != before:
        raise UserError("--tools: the chat template renders an exchange otherwise once tool results follow it; a "
                        "tool loop needs one that keeps earlier turns as they were (TRL's "
                        "get_training_chat_template has such templates for common families)")
    return after[len(before):]


@dataclass
class Played:
    """A multi-turn rollout as the host reads it at its end."""

    tokens: Any  # [rows, budget] host tensor: every token after the prompt (the model's and the tools')
    made: Any  # [rows, budget] bool: the model's tokens (in the loss), not the tools' results
    lengths: list[int]  # each row's tokens after its prompt
    completions: list[list[dict]]  # each row's turns, TRL's form for reward functions
    calls: Calls = field(default_factory=Calls)
    extra: Any = None  # what the first transfer brought besides (the rows' numbers)


@dataclass
class ToolLoop:
    """The host's side of a rollout with tools (the module docstring): `Turns` generates, this
    parses, runs and appends, one transfer each way per turn."""

    tokenizer: Any
    toolbox: Toolbox
    max_iterations: int | None  # --max-tool-calling-iterations (None: until no row calls a tool)

    def __call__(self, turns: Any, ids: Any, mask: Any, fetch: Any, extra: Any = None,
                 environments: list | None = None, agree: Any = None, schemas: list | None = None) -> Played:
        """`turns` (kernels.generate.Turns) after the pass over its left-padded prompts `ids`
        (`mask`: their real tokens); `fetch(tensors)`: the host's copies (the engine's to_host),
        `extra` fetched with the first turn (Played.extra); `environments`: each row's (--environment).
        `schemas`: each row's tools' (several environments; default: every tool's).
        `agree(n)`: the largest `n` of every process, where their forward passes call collectives
        (FSDP2, tensor, context or expert axes over several processes): they then take as many
        turns, chunks and decode steps as the one that needs most, those without rows to resume
        writing nothing (None: this process alone decides)."""
        agree = agree or (lambda n: n)
        budget = turns.budget
        turns.decode(budget - 1)
        tokens, made, cur, done, ids, mask, *rest = fetch([*turns.state(), ids, mask, *([] if extra is None else
                                                                                       [extra])])
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        rows = len(prompts)
        completions: list[list[dict]] = [[] for _ in range(rows)]
        begins = [0] * rows  # where each row's current turn begins
        calls, active, taken = Calls(), list(range(rows)), 0
        while True:  # until no row (of any process, `agree`) resumes
            feeds: list[list[int]] = [[] for _ in range(rows)]
            for r in active:
                end = int(cur[r])
                turn_ids = tokens[r, begins[r]:end].tolist()
                if not turn_ids:  # a result took the last of the budget: no turn after it (TRL's)
                    continue
                turn = parse(self.tokenizer, turn_ids, prompts[r] + tokens[r, :begins[r]].tolist(),
                             self.toolbox.schemas if schemas is None else schemas[r])
                completions[r].append(turn)
                if not turn.get("tool_calls") or (self.max_iterations is not None and taken >= self.max_iterations):
                    continue
                own = None if environments is None else environments[r]  # the row's environment
                results = calls.run(turn["tool_calls"], self.toolbox.functions_of(own))
                suffix = suffix_ids(self.tokenizer, results)
                if end + len(suffix) > budget:  # TRL's rollback: the row ends with its turn
                    continue
                completions[r] += results
                tokens[r, end:end + len(suffix)] = tokens.new_tensor(suffix)
                made[r, end:end + len(suffix)] = 0
                feeds[r] = [int(tokens[r, end - 1])] + suffix
                cur[r] = begins[r] = end + len(suffix)
            active = [r for r in range(rows) if feeds[r]]
            if not agree(len(active)):
                break
            done = done.new_tensor([int(not feeds[r] or int(cur[r]) >= budget) for r in range(rows)])
            turns.resume(tokens, made, cur, done, feeds, agree(max(map(len, feeds))))
            turns.decode(agree(max((budget - int(cur[r]) - 1 for r in active), default=0)))
            tokens, made, cur, done = fetch(turns.state())
            taken += 1
        return Played(tokens, made.bool(), [int(c) for c in cur], completions, calls, rest[0] if rest else None)
