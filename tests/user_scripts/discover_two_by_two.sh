#!/bin/sh
echo localhost:2
echo 127.0.0.1:2
