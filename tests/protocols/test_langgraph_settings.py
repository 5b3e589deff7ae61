"""The LangGraph API's settings: each read and checked once, under its own check id."""

from __future__ import annotations

from sageproject import config


def test_the_stream_length_and_the_origins_are_read_and_checked():
    loaded = config.load(
        {
            "SAGE_LANGGRAPH_STREAM_SECONDS": "5",
            "SAGE_LANGGRAPH_CORS_ORIGINS": "http://localhost:3000, https://ui.example.com/",
        }
    )
    assert loaded.errors == []
    assert loaded["SAGE_LANGGRAPH_STREAM_SECONDS"] == 5
    assert loaded["SAGE_LANGGRAPH_CORS_ORIGINS"] == (
        "http://localhost:3000",
        "https://ui.example.com",
    )
    defaults = config.load({})
    assert defaults["SAGE_LANGGRAPH_STREAM_SECONDS"] == 300
    assert defaults["SAGE_LANGGRAPH_CORS_ORIGINS"] == ()
    assert config.load({"SAGE_LANGGRAPH_CORS_ORIGINS": "*"})["SAGE_LANGGRAPH_CORS_ORIGINS"] == (
        "*",
    )


def test_bad_values_name_their_rule():
    for value in ("0", "3601", "soon"):
        problems = config.load({"SAGE_LANGGRAPH_STREAM_SECONDS": value}).errors
        assert [p.check_id for p in problems] == ["sageproject.E090"], value
    for value in ("localhost:3000", "http://ui.example.com/app", "ftp://ui.example.com"):
        loaded = config.load({"SAGE_LANGGRAPH_CORS_ORIGINS": value})
        assert [p.check_id for p in loaded.errors] == ["sageproject.E091"], value
        assert loaded["SAGE_LANGGRAPH_CORS_ORIGINS"] == ()
