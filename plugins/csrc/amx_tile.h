// The AMX tile configuration (palette 1) that amx.cpp and amx_int8.cpp load: per tile, its rows
// and bytes per row.
#pragma once
#include <stdint.h>

namespace {
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
}  // namespace
