// linattn: attention whose cost grows linearly with sequence length, and exact attention.
#pragma once

#include "linattn/core/attention_args.h"
#include "linattn/core/error.h"
#include "linattn/core/memory.h"
#include "linattn/core/tensor.h"
#include "linattn/core/random_features.h"
#include "linattn/core/threading.h"
#include "linattn/kernelized/kernelized_attention.h"
#include "linattn/kernelized/recurrent_state.h"
#include "linattn/softmax/softmax_attention.h"
#include "linattn/nystrom/nystrom_attention.h"
#include "linattn/linformer/linformer_attention.h"
#include "linattn/efficient/efficient_attention.h"
