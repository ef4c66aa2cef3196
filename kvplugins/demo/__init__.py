"""The `kvplugins demo` job, in parts: model.py builds the tiny local Llama, conversation.py writes the
multi-turn prompts, engine.py runs one vLLM engine in a fresh process, run.py strings them together."""
