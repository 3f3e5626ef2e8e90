"""Agent programs for the tests (tests/test_agents.py), written against the `openai` client as any agent is."""

import json
import time

import openai

from posttrain.tools import ToolCall, load_tools


def client_of(client):
    return openai.OpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)


def calculator_agent(row, client):
    """Asks the model, runs the calculator calls it makes, gives their results back, until it answers."""
    llm, tools = client_of(client), load_tools(functions=["calculator"])
    messages = list(row["prompt"])
    for _ in range(3):
        reply = llm.chat.completions.create(model=client["model"], messages=messages, tools=tools.schemas,
                                            temperature=0)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = tools.run([ToolCall(call.function.name, json.loads(call.function.arguments))])[0]
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": result.content})
    tools.close()
    return None  # the reward function scores the last answer


def one_shot(row, client):
    """One question, one answer; the reward: 1 if the answer is the row's ground truth."""
    reply = client_of(client).chat.completions.create(model=client["model"], messages=row["prompt"])
    return float(reply.choices[0].message.content.strip() == str(row["reward_model"]["ground_truth"]))


def ask_twice(row, client):
    """Answers, then is told to check and answers again (the second prompt extends the first conversation)."""
    llm = client_of(client)
    messages = list(row["prompt"])
    first = llm.chat.completions.create(model=client["model"], messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Check it."}]
    llm.chat.completions.create(model=client["model"], messages=messages)
    return None


def misbehaving(row, client):
    """What the row's extra_info.how says: raise, return junk, hang, or never ask."""
    how = row["extra_info"]["how"]
    if how == "raise":
        raise RuntimeError("the agent broke")
    if how == "junk":
        client_of(client).chat.completions.create(model=client["model"], messages=row["prompt"])
        return "great"
    if how == "hang":
        time.sleep(120)  # past the test's limit; a daemon thread, it does not hold the tests up
    if how == "silent":
        return 1.0
    return one_shot(row, client)
