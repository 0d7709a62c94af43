"""Conversations of every shape the ChatML tests read (helpers, no tests)."""

SINGLE = [
    {"role": "system", "content": "speak a sentence"},
    {"role": "user", "content": "hello, how are you?"},
    {"role": "assistant", "content": "i am fine, thank you."},
]
PARTS = [
    {
        "role": "user",
        "content": [
            {"type": "audio", "path": "weather.wav"},
            {"type": "text", "text": "the weather today"},
        ],
    },
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "the quick brown fox"},
            {"type": "text", "text": " jumps over the lazy dog."},
        ],
    },
]
MULTI = [
    {"role": "user", "content": "hello, how are you?"},
    {"role": "assistant", "content": "i am fine."},
    {"role": "user", "content": "speak a sentence about the weather"},
    {"role": "assistant", "content": "the weather is fine today, thank you."},
]
TOOL = [
    {"role": "user", "content": "the weather?"},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "it is sunny."},
]
