"""Tools through the chat template: the prompt that offers them (the template's own tool section, or
the system message for a template that ignores tools), Hermes calls read back, and tool results
appended as the template writes a tool turn, for the tiny model's ChatML template and a Qwen2.5-style one."""

from __future__ import annotations

import pytest

from ppo_trainer.agents import check_tool_template, load_tools, parse_tool_calls, render_prompt_with_tools
from ppo_trainer.agents.template import Observations, tools_system_text
from ppo_trainer.agents.tools import ToolCall
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.models.tiny import build_tiny_tokenizer

# Qwen2.5-Instruct's template, as far as tools go: the tool section in the system turn, assistant
# tool_calls in Hermes blocks, consecutive tool results in one user turn of <tool_response> blocks.
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3.1's way of asking for calls: tools shown, calls as bare JSON (no <tool_call> tags)
JSON_CALLS_TEMPLATE = (
    "{%- if tools %}Respond with {\"name\": function name, \"parameters\": dictionary}. {{ tools | tojson }}"
    "{%- endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a template that knows no tool role
NO_TOOL_ROLE_TEMPLATE = (
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + m.role) }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def qwen():
    return build_tiny_tokenizer(chat_template=QWEN25_TEMPLATE)


@pytest.fixture(scope="module")
def tools():
    return load_tools(["calculator", "python"])


def test_a_template_that_renders_tools_gets_them_and_its_system_turn_is_left_alone(qwen, tools):
    text, in_system = render_prompt_with_tools(qwen, [{"role": "user", "content": "2+2?"}], tools)
    assert not in_system
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                           "\n\n# Tools\n")
    assert '"name": "calculator"' in text and text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_ignores_tools_gets_the_schemas_and_the_hermes_format_in_its_system_message(tiny, tools):
    schemas = [t.schema for t in tools]
    text, in_system = render_prompt_with_tools(tiny, [{"role": "user", "content": "2+2?"}], tools)
    assert in_system
    assert text == f"<|im_start|>system\n{tools_system_text(schemas)}<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    text, _ = render_prompt_with_tools(tiny, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "2+2?"}], tools)
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{tools_system_text(schemas)}<|im_end|>\n")
    assert "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" in text


def test_without_tools_the_prompt_is_the_template_s_plain_rendering(tiny):
    assert render_prompt_with_tools(tiny, [{"role": "user", "content": "hi"}], []) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False)


def test_hermes_calls_are_read_in_order_with_unreadable_ones_kept_as_errors():
    text = ('I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>{"name": "lookup", "parameters": {"city": "Oslo"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
            '<tool_call>["calculator"]</tool_call><tool_call>{"name": "x", "arguments": 3}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}')  # a turn cut before its close
    calls = parse_tool_calls(text)
    assert calls[:3] == [ToolCall("calculator", {"expression": "1+1"}), ToolCall("python", {"code": "print(1)"}),
                         ToolCall("lookup", {"city": "Oslo"})]
    assert calls[3].error.startswith("the tool call is not valid JSON (Expecting value at character")
    assert calls[4].error == 'the tool call needs a "name" (text) and "arguments" (an object)'
    assert calls[5] == ToolCall("x", error='the "arguments" of x are not an object')
    assert calls[6] == ToolCall("calculator", {"expression": "2*3"})
    assert parse_tool_calls("The answer is 4.") == []


@pytest.mark.parametrize("template", ["tiny", "qwen"])
@pytest.mark.parametrize("closed", [True, False])
def test_prompt_action_and_tool_observation_tokens_equal_the_template_s_rendering_of_the_conversation(
        request, template, closed, tools):
    tokenizer = request.getfixturevalue(template)
    user = {"role": "user", "content": "2+2?"}
    action = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    results = [{"role": "tool", "content": "4"}, {"role": "tool", "content": "Error: no"}]
    ids = Observations(tokenizer).ids
    prompt, _ = render_prompt_with_tools(tokenizer, [user], tools)
    turn = ids(prompt) + ids(action) + ([tokenizer.eos_token_id] if closed else [])
    observation = Observations(tokenizer).text(results, closed)
    system = prompt[:prompt.index("<|im_start|>user")]
    whole = tokenizer.apply_chat_template([user, {"role": "assistant", "content": action}, *results], tokenize=False,
                                          add_generation_prompt=True, tools=[t.schema for t in tools])
    whole = whole if template == "qwen" else system + whole
    assert turn + ids(observation) == ids(whole)
    expected = {"tiny": "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>tool\nError: no<|im_end|>\n<|im_start|>assistant\n",
                "qwen": "\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\nError: no\n"
                        "</tool_response><|im_end|>\n<|im_start|>assistant\n"}[template]
    assert observation == expected if closed else observation == "<|im_end|>" + expected


def test_long_tool_results_are_cut_inside_their_contents_so_the_next_assistant_header_stays(qwen):
    observations = Observations(qwen)
    messages = [{"role": "tool", "content": "a" * 100}, {"role": "tool", "content": "b" * 100}]
    frame = len(observations.ids(observations.text([{"role": "tool", "content": ""}] * 2, True)))
    ids, shown, cut = observations.turns(messages, True, frame + 20)
    assert cut and [m["content"] for m in shown] == ["a" * 10, "b" * 10]
    assert len(ids) == frame + 20 and qwen.decode(ids).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert observations.turns(messages, True, 1000) == (observations.ids(observations.text(messages, True)), messages,
                                                        False)


def test_environment_feedback_is_tokenized_verbatim_and_cut_to_its_first_tokens(tiny):
    assert Observations(tiny).verbatim("\n<|im_start|>user\nno", 100) == (tiny("\n<|im_start|>user\nno",
                                                                              add_special_tokens=False)["input_ids"],
                                                                         False)
    ids, cut = Observations(tiny).verbatim("abcdef", 4)
    assert cut and tiny.decode(ids) == "abcd"


def test_a_template_that_asks_for_another_call_format_or_knows_no_tool_turn_is_refused_naming_the_key(tools):
    with pytest.raises(ConfigError, match="'sampler.multi_turn.tools' is set, but the model's chat template asks for "
                                          "tool calls in a format other than Hermes"):
        check_tool_template(build_tiny_tokenizer(chat_template=JSON_CALLS_TEMPLATE), tools)
    with pytest.raises(ConfigError, match=r"'sampler.multi_turn.tools' is set, but the model's chat template refuses "
                                          r"these turns \(roles: user, assistant, tool\): Unknown role: tool"):
        check_tool_template(build_tiny_tokenizer(chat_template=NO_TOOL_ROLE_TEMPLATE), tools)


def test_hermes_templates_and_templates_that_ignore_tools_pass_the_check(tiny, qwen, tools):
    check_tool_template(tiny, tools)
    check_tool_template(qwen, tools)
    check_tool_template(build_tiny_tokenizer(chat_template=JSON_CALLS_TEMPLATE), [])
