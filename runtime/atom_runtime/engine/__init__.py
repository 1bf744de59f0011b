"""The engine: EngineCore (scheduler + model runner busy loop) and the messages it speaks."""
