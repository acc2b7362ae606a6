"""output_ids -> text_output. Streamed chunks arrive cut at character boundaries (the angelspec
model holds back tokens that end inside a multi-byte character), so each decodes on its own."""
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

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy().reshape(-1)
            text = self.tok.decode(ids.tolist(), skip_special_tokens=True)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object))]))
        return responses
