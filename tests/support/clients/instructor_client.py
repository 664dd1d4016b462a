"""instructor against a running Candor, run in its own virtual environment.

instructor pins ``jiter<0.15`` while the openai SDK the rest of the tests use needs a newer
one, so the two cannot share an environment: ``make test`` builds ``.venv-instructor`` with
instructor and the openai SDK it picks, and the test runs this script there, as a user's
separate program would. Prints one JSON object of what each mode returned.
"""

from __future__ import annotations

import json
import sys
import instructor
import openai
from pydantic import BaseModel, Field


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)


def main(base_url: str, model: str) -> None:
    raw = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    out: dict[str, object] = {"instructor": instructor.__version__}
    ask = [{"role": "user", "content": "Describe a person"}]
    # TOOLS / TOOLS_STRICT: a named tool_choice; JSON_SCHEMA: response_format json_schema
    for mode in (instructor.Mode.TOOLS, instructor.Mode.TOOLS_STRICT,
                 instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(raw, mode=mode)
        person = client.chat.completions.create(model=model, response_model=Person,
                                                messages=ask, max_tokens=200, seed=1,
                                                max_retries=0)
        out[mode.value] = person.model_dump()
    # streamed partial objects: the last partial is the whole, validated object
    client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
    partials = list(client.chat.completions.create_partial(
        model=model, response_model=Person, messages=ask, max_tokens=200, seed=2,
        max_retries=0))
    out["partial_count"] = len(partials)
    out["partial_last"] = Person.model_validate(partials[-1].model_dump()).model_dump()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
