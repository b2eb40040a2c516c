"""The web page (`asr app`, `python -m app`): transcribe an uploaded file, or the microphone live."""
