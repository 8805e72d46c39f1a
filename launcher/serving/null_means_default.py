"""The base of the OpenAI request models: null for an optional field means its default."""

from __future__ import annotations

from pydantic import BaseModel, model_validator


class NullMeansDefault(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, body):
        """OpenAI's API takes null for any optional parameter, meaning its default (clients that
        serialise every field send them), inside nested objects too: a null field is as if it were
        left out."""
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body
