"""text_input -> input_ids (the engine's tokenizer and chat template); stop_words -> stop_ids."""
import json
import os
import pathlib

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        # text work yields the cores to the engine's step (both cores run its parallel regions:
        # a preempted thread stalls the whole region); it runs in the gaps between steps
        os.nice(5)

        cfg = json.loads(args["model_config"])
        engine = pathlib.Path(cfg["parameters"]["engine_dir"]["string_value"])
        self.tok = AutoTokenizer.from_pretrained(str(engine / "target"))

    def encode(self, request):
        raw = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)
        if raw.size != 1:
            raise ValueError(f"text_input must hold exactly one string, got {raw.size}")
        value = raw[0]
        try:
            text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        except UnicodeDecodeError as exc:
            raise ValueError(f"text_input is not valid UTF-8 ({exc})") from None
        if not text.strip():
            raise ValueError("text_input is empty: give some text to respond to")
        if self.tok.chat_template:
            ids = self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                               add_generation_prompt=True)
        else:
            ids = self.tok.encode(text, add_special_tokens=False)
        stops = []
        words = pb_utils.get_input_tensor_by_name(request, "stop_words")
        for w in ([] if words is None else words.as_numpy().reshape(-1)):
            w = w.decode("utf-8", errors="strict") if isinstance(w, bytes) else str(w)
            if not w:
                continue
            wid = self.tok.encode(w, add_special_tokens=False)
            if len(wid) != 1:
                raise ValueError(f"stop word {w!r} is {len(wid)} tokens; stop words must be single tokens")
            stops.append(wid[0])
        return np.array(ids, dtype=np.int32), np.array(stops, dtype=np.int32)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids, stops = self.encode(request)
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("stop_ids", stops)]))
            except Exception as exc:  # one bad request gets its own error; others go on
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses
