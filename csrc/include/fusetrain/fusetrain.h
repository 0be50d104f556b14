// Umbrella header of fusetrain's public C++ API.
#pragma once

#include <fusetrain/build_info.h>
#include <fusetrain/ops.h>
#include <fusetrain/optim.h>
#include <fusetrain/amp.h>
#include <fusetrain/step.h>
