"""The tool-call syntax redserve reads and, when a chat template has no tool format of its
own, teaches: the Hermes convention that Qwen2.5, Hermes and SmolLM2's function-calling data
share. Each call is a JSON object (or a list of them, as SmolLM2 writes) between tags:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and a tool's result goes back to the model between `<tool_response>` tags.
"""

from __future__ import annotations

START = "<tool_call>"
END = "</tool_call>"
RESULT_START = "<tool_response>"
RESULT_END = "</tool_response>"
