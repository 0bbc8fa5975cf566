"""Stub of download_weights_from_hf: nothing is downloaded; the name of the model stays the name
the demo is served under."""


def download_weights_from_hf(model_name_or_path: str, *args: object, **kwargs: object) -> str:
    return model_name_or_path
