"""toolledger.gateway"""
